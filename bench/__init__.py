"""Benchmarks: `python -m bench.<name>` from the repository root. Each measures Folio against a named baseline in
the same run (ratios: absolute figures depend on the machine), prints a table and writes JSON (and a PNG) under
bench/results/. Timing lives here, never in the tests; `tests/reliability/` runs the reliability sections at CI
sizes.

Helpers shared with the tests are importable from the packages (`app/testing.py`, `model/testing.py`); what only
the benchmarks share is in `bench/report.py` (percentiles, JSON and PNG) and `bench/models.py` (GPT-2 shapes).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# the data sets live beside the repository, never inside it (docs/tests.md)
SHARED_DATA = REPO.parent / "shared" / "data"
