"""What a run leaves in its output directory besides checkpoints: the metrics log (`metrics.jsonl`, one JSON
object per line: training rows with `loss`, evaluation rows with `train_loss`/`val_loss`) and the loss curve
drawn from it (`loss.png`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from model.checkpoint import CONFIG_FILE, NEXT_CONFIG_FILE, WEIGHTS_FILE
from model.files import atomic_path
from model.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from model.tokenizer import BPE_FILE

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
# what a run leaves in OUT; OUT/data/ (the tokenized text, reused by any run on the same text) is not the run's
RUN_FILES = (CONFIG_FILE, NEXT_CONFIG_FILE, WEIGHTS_FILE, BPE_FILE, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
             METRICS_FILE, PLOT_FILE, "last", "last.old", "last.tmp")


def delete_run(out: Path) -> None:
    """--overwrite: the run already in `out` goes, so that its checkpoints and metrics never mix with a new one's."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def log_metrics(out: Path, record: dict[str, Any]) -> None:
    with open(out / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(out: Path, step: int) -> None:
    """Drop what was logged after the checkpoint at `step`. The training row for `step` was logged before that
    checkpoint and is kept; an evaluation at `step` is dropped, since the resumed loop evaluates `step` again
    (same weights, same eval batches, so the same row comes back)."""
    path = out / METRICS_FILE
    if path.is_file():
        rows = [ln for ln in path.read_text().splitlines() if ln]
        keep = [ln for ln in rows if (r := json.loads(ln))["step"] < step or (r["step"] == step and "loss" in r)]
        path.write_text("".join(ln + "\n" for ln in keep))


def plot_metrics(metrics: Path, png: Path) -> None:
    """Loss curve: training loss per log interval and evaluated train/val loss, against step. Written to a
    temporary file renamed over `png`, so a viewer never opens half an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln] if metrics.is_file() else []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["train_loss"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="train (batch)")
    if evals:
        s, tr, va = zip(*evals)
        ax.plot(s, tr, "o-", label="train (eval)")
        ax.plot(s, va, "o-", label="val (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(metrics.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)

