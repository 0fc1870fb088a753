"""Training: `python -m model.train` (the command line, `__main__.py`, whose docstring tells the whole story)
and the run behind it: its configuration (`config`), optimiser and schedule (`optim`), the loop (`trainer`),
exact resumption (`resume`) and what it writes beside the checkpoints (`outputs`)."""
