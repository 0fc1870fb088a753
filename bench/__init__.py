"""Benchmarks: `python -m bench.<name>` from the repository root. Each measures Folio against a named baseline in
the same run (ratios: absolute figures depend on the machine), prints a table and writes JSON (and a PNG) under
bench/results/. Timing lives here, never in the tests; `tests/reliability/` runs the reliability sections at CI
sizes.

Helpers shared with the tests are importable from the packages (`app/testing.py`, `model/testing.py`); what only
the benchmarks share is in `bench/report.py` (percentiles, JSON and PNG), `bench/models.py` (GPT-2 shapes) and
here (where the data live, and the trainer's split of a text).
"""

from pathlib import Path

from model.data import TRAIN_FRACTION

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# the data sets live beside the repository, never inside it (docs/tests.md)
SHARED_DATA = REPO.parent / "shared" / "data"


def training_split(text: str) -> str:
    """The part of a text the trainer trains on (model/data.py: its first TRAIN_FRACTION; exactly for a character
    model, whose tokens are its characters, and to within a token or so for BPE)."""
    return text[:int(len(text) * TRAIN_FRACTION)]


def validation_split(text: str) -> str:
    """The rest: what the benchmarks evaluate on, never trained on."""
    return text[int(len(text) * TRAIN_FRACTION):]
