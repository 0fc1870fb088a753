"""Tiny training runs for the train tests: one layer, 32 wide, 32 tokens of context, a 20 KB text, tens of
steps, run in process through `main(argv)`; and what a run leaves behind, read back (metrics, weights)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from model.train.__main__ import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# one layer, 32 wide, 32 tokens of context; eval and checkpoint every 10 steps; no dropout
TINY = [
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
    "--dropout", "0", "--learning-rate", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "5",
    "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "5", "--device", "cpu", "--no-progress",
]


def tiny_argv(text: Path, out: Path, *extra: str, max_iters: int = 40) -> list[str]:
    return ["--data", str(text), "--out", str(out), *TINY, "--max-iters", str(max_iters), *extra]


def train(argv: list[str]) -> None:
    assert main(argv) == 0


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]


def loss_rows(out: Path) -> list[tuple]:
    """Everything in metrics.jsonl that a rerun must reproduce (throughput is left out)."""
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("train_loss"), r.get("val_loss")) for r in metrics(out)]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"tensors differ between {a} and {b}: {different}"


def write_file(path: Path, content: str | bytes) -> Path:
    """`content` (text as UTF-8) written to `path`, returned."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path
