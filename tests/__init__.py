"""Folio's test suite, laid out like the packages it tests (`python -m pytest -q` from the repository root).

Helpers that benchmarks use too live in the packages, importable like `torch.testing`: `app/testing.py` (a
server process, the wire formats) and `model/testing.py` (tiny checkpoints).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
