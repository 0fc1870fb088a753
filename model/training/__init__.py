"""The training run behind `python -m model.train` (whose docstring tells the whole story): its configuration
(`config`), optimiser and schedule (`optim`), the loop (`trainer`), exact resumption (`resume`) and what it
writes beside the checkpoints (`outputs`)."""
