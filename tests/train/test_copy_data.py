"""The copy model's training data (bench/copy_model.py): rows drawn from the training split only, in the
benchmark's copy shape (a passage starting at a line, a blank line, the passage again as the completion) or
ordinary windows of the text, as the trainer reads them; and the cache is reused only for the same recipe and
base."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from bench import copy_model, training_split, validation_split
from bench.copy_model import RECIPE, RECIPE_FILE, examples, is_built, line_passages
from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from model.tokenizer import CharTokenizer
from model.train.instructions import IGNORE_INDEX, prepare_instructions

# a text whose training split (the first 90%) is lower case and whose validation split is upper case, so that a
# character of the validation split in a row is seen at once
LINES = [" ".join(random.Random(i).choice(["the", "cat", "sat", "on", "a", "mat", "and", "sang"]) for _ in range(7))
         for i in range(400)]
TRAIN = "\n".join(LINES) + "\n"
TEXT = TRAIN + "\n".join(line.upper() for line in LINES[:44]) + "\n"
SETTINGS = dict(copies=300, windows=200, min_passage=12, max_passage=40, window=50, seed=3)


def test_the_splits_are_the_trainers():
    assert training_split(TEXT) == TRAIN[:int(len(TEXT) * 0.9)]
    assert training_split(TEXT) + validation_split(TEXT) == TEXT
    assert not any(c.isupper() for c in training_split(TEXT))


def test_rows_come_from_the_training_split_only_in_the_copy_shape():
    rows = examples(TEXT, **SETTINGS)
    train = training_split(TEXT)
    copies = [r for r in rows if r["prompt"]]
    windows = [r for r in rows if not r["prompt"]]
    assert (len(copies), len(windows)) == (300, 200)
    for r in copies:  # passage, blank line; then the passage again
        passage = r["completion"]
        assert r["prompt"] == passage + "\n\n"
        assert 12 <= len(passage) <= 40 and passage.strip()
        start = train.find(passage)
        assert start >= 0 and (start == 0 or train[start - 1] == "\n")  # found in the training split, at a line
    for r in windows:
        assert len(r["completion"]) == 50 and r["completion"] in train
    assert not any(c.isupper() for r in rows for c in r["prompt"] + r["completion"])
    assert {len(r["completion"]) for r in copies} == set(range(12, 41))  # every length drawn over 300 rows
    assert examples(TEXT, **SETTINGS) == rows  # the seed decides the rows
    assert rows[:10] != copies[:5] + windows[:5]  # shuffled together


def test_the_trainer_trains_on_the_second_copy_only(tmp_path: Path):
    rows = examples(TEXT, **SETTINGS)
    data = tmp_path / "copy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = CharTokenizer.from_text(TEXT)
    ds = prepare_instructions(data, tokenizer=tok, block_size=128)
    for row, example in zip(rows, ds.train + ds.val):
        completion = tok.encode(row["completion"])
        context = len(tok.encode(row["prompt"]))
        want = [IGNORE_INDEX] * (context - 1) + completion if context else completion[1:]
        np.testing.assert_array_equal(example.labels, want)


def test_line_passages_of_one_length_are_the_benchmarks():
    """bench/speculative.py's passages, as it drew them before it shared this function."""
    val = validation_split(TEXT)
    rng = random.Random(1)
    want = []
    while len(want) < 5:
        start = val.find("\n", rng.randrange(len(val) - 2 * 20)) + 1
        piece = val[start:start + 20]
        if len(piece) == 20 and piece.strip():
            want.append(piece)
    assert line_passages(val, 5, (20, 20), random.Random(1)) == want


def test_a_built_model_is_reused_only_for_the_same_recipe_and_base(tmp_path: Path):
    base, out = tmp_path / "base", tmp_path / "out"
    base.mkdir()
    out.mkdir()
    (base / WEIGHTS_FILE).write_bytes(b"base weights")
    (out / WEIGHTS_FILE).write_bytes(b"tuned")
    (out / CONFIG_FILE).write_text("{}")
    assert not is_built(out, base)  # no recipe.json: a build that never finished
    (out / RECIPE_FILE).write_text(json.dumps({"recipe": RECIPE, "base_sha256": copy_model.weights_sha256(base)}))
    assert is_built(out, base)
    (base / WEIGHTS_FILE).write_bytes(b"another base")
    assert not is_built(out, base)
    (out / RECIPE_FILE).write_text(json.dumps({"recipe": {**RECIPE, "copies": 1},
                                               "base_sha256": copy_model.weights_sha256(base)}))
    assert not is_built(out, base)
