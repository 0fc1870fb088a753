"""The command line of the train package: `python -m model.train` turns a text file into a Folio checkpoint.

    python -m model.train --preset shakespeare-char-cpu --data input.txt --out weights/my-model

Every `TrainConfig` field is a flag in kebab case (`--max-iters 2000`); values come from the preset, then a
`--config` file (JSON or TOML), then flags. `--resume` continues a run exactly (step, optimizer, RNG,
schedule) from `OUT/last/`. The best-validation model is written to `OUT/` itself (what the server loads);
`OUT/last/` holds the latest periodic checkpoint plus `resume.pt`. Metrics go to `OUT/metrics.jsonl` and the
loss curve to `OUT/loss.png` (redrawn at every evaluation). SIGTERM or Ctrl-C stops a run after the step in
progress: that step logged, the curve redrawn, `OUT/last/` written (`--resume` continues it), exit code 143 or
130; a second one ends it at once. A run never starts over another one in `OUT`:
`--resume` continues it, `--overwrite` deletes it first (the tokenized text in `OUT/data/` is kept).

Fine-tuning (docs/training.md): `--init-from MODEL` starts from a model's weights, shape and tokenizer; a `.jsonl`
`--data` is instruction data, trained on its completions only (`instructions.py`); `--lora` trains an adapter on
the frozen model and writes it in PEFT's format (model/lora.py) where a checkpoint would go, in the same loop.

Distributed data parallel: `torchrun --nproc_per_node=N -m model.train ...` runs N processes (gloo on CPU,
NCCL on CUDA, one GPU per process: `cuda:LOCAL_RANK`). `--gradient-accumulation-steps` stays the global
number of micro-batches per step and is split across the ranks, so a step sees the same number of tokens
whatever N is. Rank r draws its micro-batches from its own stream (seed + r); gradients are all-reduced on
each rank's last micro-step only; evaluation splits the evaluation batches across the ranks and sums them
back; rank 0 alone logs, shows progress and writes checkpoints and metrics. `OUT/last/resume.pt` keeps every
rank's RNG streams, so `--resume` under the same N continues exactly.
"""


from __future__ import annotations

import json
import signal
import sys

from model import distributed
from model.data import DataError
from model.train.config import TrainError, resolve_config
from model.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, resume = resolve_config(argv)
        trainer = Trainer(cfg, resume=resume)
    except (TrainError, DataError, ValueError, OSError) as e:  # OSError: a file it may not read or write
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = trainer.run()
    distributed.close()  # after a failure, torchrun ends the other ranks: no waiting for them
    if trainer.is_main:
        print(json.dumps({k: v for k, v in result.items()}, default=str))
    # stopped by a signal: a shell's code for it (143 SIGTERM, 130 Ctrl-C), so that `train && serve` stops there
    return 128 + signal.Signals[result["stopped_by"]] if result["stopped_by"] else 0


if __name__ == "__main__":
    sys.exit(main())
