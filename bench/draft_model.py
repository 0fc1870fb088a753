"""A draft model for the speculative benchmark's `draft` task: a 2-layer, 64-wide character model trained from
scratch on tiny Shakespeare with the bundled model's tokenizer (the same characters: the trainer builds the
vocabulary from the same text), 1,500 steps.

    python -m bench.draft_model [--out ~/.cache/folio/draft-model] [--force]

It goes to a cache directory outside the repository with `recipe.json`; `draft_model()` reuses it while the recipe
is unchanged and trains it otherwise (about 2 minutes on one core of a 2-core Xeon; validation loss 1.91 against
the bundled model's 1.51).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import RECIPE_FILE, built_from, cached_model, cached_model_main
from bench.copy_model import TEXT

CACHE = Path.home() / ".cache" / "folio" / "draft-model"
RECIPE = {"preset": "shakespeare-char-small", "n_layer": 2, "n_head": 2, "n_embd": 64, "max_iters": 1500,
          "lr_decay_iters": 1500, "eval_interval": 500, "threads": 1}


def is_built(out: Path) -> bool:
    """Whether `out` holds a draft model trained by this recipe."""
    return built_from(out, RECIPE)


def build(out: Path = CACHE) -> None:
    """Train the draft into `out` (the trainer's progress on stderr) and write its recipe."""
    from model.train.__main__ import main as train

    out.mkdir(parents=True, exist_ok=True)
    (out / RECIPE_FILE).unlink(missing_ok=True)  # a build stopped half-way is not a built model
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in RECIPE.items()]
    code = train(["--data", str(TEXT), "--out", str(out), "--device", "cpu", "--overwrite", *flags])
    if code:
        raise SystemExit(f"training the draft model failed (exit code {code})")
    (out / RECIPE_FILE).write_text(json.dumps(RECIPE))


def draft_model(out: Path = CACHE) -> Path:
    """The draft model's directory: `out`, trained first unless it holds this recipe's model."""
    return cached_model(out, is_built, build, "draft model")


def main() -> None:
    cached_model_main(__doc__, CACHE, is_built, build, lambda out: f"{out}\n")


if __name__ == "__main__":
    main()
