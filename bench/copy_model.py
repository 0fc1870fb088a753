"""A model that copies from its prompt, for the speculative benchmark's `copy` task: the bundled character model
fine-tuned (all weights, `python -m model.train --init-from`) on quoting examples from the training split.

    python -m bench.copy_model [--out ~/.cache/folio/copy-model] [--force]

The bundled model never learned to copy: given a passage, a blank line and the passage's beginning, it goes on in
its own words. The data (`examples`) is drawn from the training split only (the first 90% of tinyshakespeare, as
the trainer splits it; the benchmark's passages come from the last 10%): half the rows are shaped like the
benchmark's copy prompt, a passage starting at a line, a blank line, then the passage again (its second copy the
completion, so the loss is on copying), and half are ordinary windows of the text, every token trained, so that
the model keeps its language. The checkpoint goes to a cache directory outside the repository, with
`recipe.json` (the recipe, and the base's weights' sha256) and `report.json` (validation loss on ordinary text,
before and after, and copy accuracy on validation passages); `copy_model()` reuses it while the recipe and the base
are unchanged and builds it otherwise (minutes on two CPU cores; the trainer shows its progress).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench import (
    RECIPE_FILE,
    REPO,
    SHARED_DATA,
    built_from,
    cached_model,
    cached_model_main,
    training_split,
    validation_split,
)
from model.checkpoint import WEIGHTS_FILE, Checkpoint, load_checkpoint
from model.engine import Engine
from model.sampling_params import SamplingParams
from model.train.trainer import lm_loss

BUNDLED = REPO / "weights" / "shakespeare-char"
TEXT = SHARED_DATA / "tinyshakespeare" / "input.txt"
CACHE = Path.home() / ".cache" / "folio" / "copy-model"
DATA_FILE = "copy-data.jsonl"
REPORT_FILE = "report.json"
PASSAGE = 56  # characters of the benchmark's copy passages: passage, blank line and beginning fit the 128-token context
BEGINNING = 8  # characters of the passage the benchmark's copy prompt repeats
# the data and the run; a change here builds the model again
RECIPE: dict[str, Any] = {
    "copies": 12000, "windows": 5000, "min_passage": 24, "max_passage": 60, "window": 129, "seed": 0,
    "train": {"max_iters": 800, "batch_size": 16, "learning_rate": 2e-3, "min_lr": 2e-4, "warmup_iters": 20,
              "dropout": 0.0, "eval_interval": 400, "eval_iters": 10, "log_interval": 10, "seed": 1337, "threads": 1},
}


def line_passages(text: str, n: int, lengths: tuple[int, int], rng: random.Random) -> list[str]:
    """`n` passages of `text`, each starting at a line and of a length in `lengths` (inclusive), not blank."""
    out: list[str] = []
    while len(out) < n:
        length = lengths[0] if lengths[0] == lengths[1] else rng.randint(*lengths)
        start = text.find("\n", rng.randrange(len(text) - 2 * length)) + 1
        piece = text[start:start + length]
        if len(piece) == length and piece.strip():
            out.append(piece)
    return out


def examples(text: str, *, copies: int, windows: int, min_passage: int, max_passage: int, window: int,
             seed: int) -> list[dict[str, str]]:
    """Prompt/completion rows (model/train/instructions.py) from the training split of `text` only, shuffled:
    `copies` rows of a passage and a blank line as prompt and the passage again as completion, and `windows` rows
    of `window` characters of ordinary text as completion, with an empty prompt."""
    train = training_split(text)
    rng = random.Random(seed)
    rows = [{"prompt": f"{p}\n\n", "completion": p} for p in line_passages(train, copies, (min_passage, max_passage),
                                                                          rng)]
    for _ in range(windows):
        start = rng.randrange(len(train) - window + 1)
        rows.append({"prompt": "", "completion": train[start:start + window]})
    rng.shuffle(rows)
    return rows


def weights_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()


def copy_prompts(ck: Checkpoint, passages: list[str]) -> list[list[int]]:
    """The benchmark's copy prompts: a passage, a blank line, then its first BEGINNING characters."""
    return [ck.tokenizer.encode(f"{p}\n\n{p[:BEGINNING]}") for p in passages]


def evaluate(ck: Checkpoint, text: str, passages: int = 64) -> dict[str, float]:
    """Validation loss (nats per character) on the ordinary validation text (windows of the context, not
    overlapping), and how well the model copies
    `passages` validation passages of PASSAGE characters given as the benchmark gives them (greedy): the share
    copied exactly, and the mean share of each passage's rest copied before the first wrong character."""
    val = validation_split(text)
    block = ck.config.block_size
    ids = torch.tensor(ck.tokenizer.encode(val))
    windows = ids[:len(ids) // (block + 1) * (block + 1)].view(-1, block + 1)  # every window's first token unscored
    with torch.inference_mode():
        losses = [lm_loss(ck.model(w[:, :-1]), w[:, 1:].contiguous()).item() * len(w) for w in windows.split(64)]
    loss = sum(losses) / len(windows)
    chosen = line_passages(val, passages, (PASSAGE, PASSAGE), random.Random(1))
    params = SamplingParams(max_new_tokens=PASSAGE - BEGINNING)
    engine = Engine(ck, device="cpu", threads=1, max_batch_size=passages).start()

    async def batch() -> list[str]:
        streams = [engine.submit(p, params) for p in copy_prompts(ck, chosen)]
        return [r.text for r in await asyncio.gather(*(s.collect() for s in streams))]

    try:
        texts = asyncio.run(batch())
    finally:
        engine.stop()
    prefixes = []
    for passage, got in zip(chosen, texts):
        want = passage[BEGINNING:]
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        prefixes.append(same / len(want))
    return {"val_loss": round(loss, 4),
            "copied_exactly": round(sum(p == 1.0 for p in prefixes) / len(prefixes), 3),
            "copied_prefix": round(sum(prefixes) / len(prefixes), 3)}


def is_built(out: Path, base: Path = BUNDLED) -> bool:
    """Whether `out` holds a copy model built by this recipe from `base` as it is now."""
    return built_from(out, {"recipe": RECIPE, "base_sha256": weights_sha256(base)})


def build(out: Path = CACHE, base: Path = BUNDLED) -> dict[str, Any]:
    """Write the data, fine-tune `base` on it into `out` (the trainer's progress bar on stderr), evaluate both and
    write `recipe.json` and `report.json`; returns the report."""
    from model.train.__main__ import main as train

    text = TEXT.read_text()
    out.mkdir(parents=True, exist_ok=True)
    (out / RECIPE_FILE).unlink(missing_ok=True)  # a build stopped half-way is not a built model
    data = out / DATA_FILE
    rows = examples(text, **{k: v for k, v in RECIPE.items() if k != "train"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in RECIPE["train"].items()]
    start = time.perf_counter()
    code = train(["--init-from", str(base), "--data", str(data), "--out", str(out), "--device", "cpu",
                  "--overwrite", *flags])
    if code:
        raise SystemExit(f"training the copy model failed (exit code {code})")
    minutes = (time.perf_counter() - start) / 60
    report = {"train_minutes": round(minutes, 1), "before": evaluate(load_checkpoint(base), text),
              "after": evaluate(load_checkpoint(out), text)}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (out / RECIPE_FILE).write_text(json.dumps({"recipe": RECIPE, "base_sha256": weights_sha256(base)}))
    return report


def copy_model(out: Path = CACHE) -> Path:
    """The copy model's directory: `out`, built first unless it holds this recipe's model."""
    return cached_model(out, is_built, build, "copy model")


def main() -> None:
    cached_model_main(__doc__, CACHE, is_built, build, lambda out: (out / REPORT_FILE).read_text())


if __name__ == "__main__":
    main()
