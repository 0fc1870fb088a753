"""Folio's model package: the GPT architecture, tokenizers, checkpoints, sampling and training.

Nothing in here imports the HTTP service (`app/`); the service builds on this package, never the reverse.
"""
