"""Reliability evidence, as figures: schema fuzzing and a bad-input table, load, overload, a disconnect storm,
the SIGTERM drain, engine faults, damaged checkpoints, a trainer killed at random, slow clients, oversized work,
hot reload while a trainer writes, and weights replaced (atomically and by a plain `cp`) under long streams.

    python -m bench.reliability [--quick] [--only fuzz,bad_inputs,...] [--seed N]

Everything runs against real processes on 127.0.0.1: `python -m app` serving the tiny random character-level
checkpoint of `model/testing.py` (96 characters, block_size 64; `hot_reload` serves the bundled model, for long
streams of a real one), and `python -m model.train` on a tiny config. A
character model has no EOS, so a request generates exactly its max_new_tokens unless a stop string ends it, and
one token is one character: every accepted request's token count can be checked exactly.

One module per section, each with a `run(...)` that returns its figures and a list of `problems` (empty means the
requirement held; the module docstrings say what each checks): `fuzz`, `bad_inputs`, `load`, `overload`,
`disconnects`, `shutdown`, `faults`, `checkpoints`, `training`, `slow_clients`, `oversized`, `reload`,
`hot_reload`. What they share:
`harness` (sizes, `Problems`, server probes), `spec` (a request as data), `outcome` (a response read and checked),
`shapes` (the body shapes of both API families), `clients` (many concurrent clients). `suite` runs them in order
on the servers they share; `__main__` is the command line.

`--quick` is the reduced form; tests/reliability/ runs these same functions in CI. Writes
bench/results/reliability.json (or --out) and prints a summary table.
"""
