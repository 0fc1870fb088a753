"""Benchmarks: `python -m bench.<name>` from the repository root. Each measures Folio against a named baseline in
the same run (ratios: absolute figures depend on the machine), prints a table and writes JSON (and a PNG) under
bench/results/. Timing lives here, never in the tests; `tests/reliability/` runs the reliability sections at CI
sizes.

Helpers shared with the tests are importable from the packages (`app/testing.py`, `model/testing.py`); what only
the benchmarks share is in `bench/report.py` (percentiles, JSON and PNG), `bench/models.py` (GPT-2 shapes) and
here (where the data live, and the trainer's split of a text). Importing this package imports nothing of
torch's (`bench.load_client`, a process of its own, starts fast); what needs the model's modules imports them
where it is used.
"""

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# the data sets live beside the repository, never inside it (docs/tests.md)
SHARED_DATA = REPO.parent / "shared" / "data"


def training_split(text: str) -> str:
    """The part of a text the trainer trains on (model/data.py: its first TRAIN_FRACTION; exactly for a character
    model, whose tokens are its characters, and to within a token or so for BPE)."""
    from model.data import TRAIN_FRACTION

    return text[:int(len(text) * TRAIN_FRACTION)]


def validation_split(text: str) -> str:
    """The rest: what the benchmarks evaluate on, never trained on."""
    return text[len(training_split(text)):]


RECIPE_FILE = "recipe.json"  # beside a cached model: what it was built from (`built_from`)


def built_from(out: Path, recipe: object) -> bool:
    """Whether `out` holds a whole checkpoint (weights and config) whose RECIPE_FILE says it was built from
    `recipe` (any JSON value)."""
    from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE

    try:
        found = json.loads((out / RECIPE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (out / WEIGHTS_FILE).is_file() and (out / CONFIG_FILE).is_file() and found == recipe


def cached_model(out: Path, is_built: Callable[[Path], bool], build: Callable[[Path], object], what: str) -> Path:
    """A model a benchmark trains for itself (`bench.copy_model`, `bench.draft_model`): `out`, built first (by
    `build`, minutes) unless `is_built(out)` (it holds the current recipe's model)."""
    if not is_built(out):
        print(f"building the {what} in {out} (minutes)", file=sys.stderr)
        build(out)
    return out


def cached_model_main(doc: str, default: Path, is_built: Callable[[Path], bool], build: Callable[[Path], object],
                      show: Callable[[Path], str]) -> None:
    """`python -m bench.<model>`: build into --out (`default`) unless built there (or --force), then print `show`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, default=default, help="where the checkpoint goes (outside the repository)")
    p.add_argument("--force", action="store_true", help="build it again even where it is built")
    args = p.parse_args()
    if args.force or not is_built(args.out):
        build(args.out)
    print(show(args.out), end="")
