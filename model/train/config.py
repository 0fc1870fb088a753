"""What a training run is: `TrainConfig` (every field a flag), the presets, and the checks a configuration
passes before anything is built. Values come from the preset, then a `--config` file, then flags; `--resume`
takes the saved run's configuration instead of the preset and the file. With `--init-from` the shape and tokenizer
(`SHAPE_FIELDS`) are the starting model's: setting one in the file or a flag is an error (a preset's are replaced)."""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from model.checkpoint import CheckpointError
from model.cli import ArgumentParser, check_threads
from model.distributed import DistEnv
from model.lora.adapter import DEFAULT_TARGETS, TARGETS, AdapterError, LoRAConfig
from model.train.outputs import RUN_FILES
from model.train.resume import last_dir, read_training


@dataclass
class TrainConfig:
    data: str = ""
    out: str = ""
    preset: str = ""
    tokenizer: str = "char"  # 'char' (vocabulary from the text) or 'gpt2' (BPE)
    bpe_dir: str = ""  # folder with GPT-2's vocab.bpe + encoder.json; empty: $FOLIO_GPT2_BPE_DIR or download
    # fine-tuning (docs/training.md, Fine-tuning and LoRA)
    init_from: str = ""  # start from this model (Folio checkpoint, HF GPT-2 dir, nanoGPT ckpt.pt): its shape, tokenizer
    data_format: str = "auto"  # 'text', 'jsonl' (instructions: model/train/instructions.py); auto: by the suffix
    lora: bool = False  # train a LoRA adapter on the --init-from model, which stays frozen
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = ",".join(DEFAULT_TARGETS)  # comma-separated, of model/lora.py's TARGETS
    # model
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    bias: bool = False
    dropout: float = 0.2
    # optimisation
    batch_size: int = 64
    gradient_accumulation_steps: int = 1
    max_iters: int = 5000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 0  # 0: max_iters
    decay_lr: bool = True
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    # evaluation, checkpoints, logging
    eval_interval: int = 250
    eval_iters: int = 200
    checkpoint_interval: int = 0  # 0: eval_interval
    log_interval: int = 10
    stop_after: int = 0  # stop after this many iterations in this process (time-boxing); 0: run to max_iters
    overwrite: bool = False  # delete a run already in --out and start afresh (without it, such a run is refused)
    # system
    device: str = "auto"  # auto, cpu, cuda, cuda:N, mps
    compile: bool = False
    threads: int = 0  # CPU threads for torch; 0: torch's default
    seed: int = 1337
    progress: bool = True


PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's config/train_shakespeare_char.py
    "shakespeare-char": dict(
        n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2, learning_rate=1e-3,
        min_lr=1e-4, max_iters=5000, lr_decay_iters=5000, warmup_iters=100, beta2=0.99, eval_interval=250,
        eval_iters=200, log_interval=10,
    ),
    # nanoGPT's README command for a CPU
    "shakespeare-char-cpu": dict(
        n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0, learning_rate=1e-3,
        min_lr=1e-4, max_iters=2000, lr_decay_iters=2000, warmup_iters=100, beta2=0.99, eval_interval=250,
        eval_iters=20, log_interval=10,
    ),
    # Folio's bundled default (weights/shakespeare-char): val loss 1.508 in 3000 steps (12.3M tokens), 40-45
    # minutes on two idle CPU cores; no dropout, since it sees each character only ~12 times
    "shakespeare-char-small": dict(
        n_layer=6, n_head=6, n_embd=192, block_size=128, batch_size=32, dropout=0.0, learning_rate=2e-3,
        min_lr=2e-4, max_iters=3000, lr_decay_iters=3000, warmup_iters=100, beta2=0.99, eval_interval=500,
        eval_iters=40, log_interval=10,
    ),
    # nanoGPT's config/train_gpt2.py, GPT-2 small's shape with biases so it maps onto GPT-2 weights
    "gpt2-124m": dict(
        tokenizer="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=True, dropout=0.0,
        batch_size=12, gradient_accumulation_steps=40, max_iters=600000, lr_decay_iters=600000,
        learning_rate=6e-4, min_lr=6e-5, warmup_iters=2000, beta2=0.95, weight_decay=0.1, eval_interval=1000,
        eval_iters=200, log_interval=10,
    ),
}


# what --init-from takes from its model, so that a run starting from one may not set them
SHAPE_FIELDS = ("tokenizer", "n_layer", "n_head", "n_embd", "block_size", "bias")
DATA_FORMATS = ("auto", "text", "jsonl")


class TrainError(ValueError):
    """A training setup that cannot run; raised before any training step."""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m model.train",
        description="Train a GPT on a text file and write a Folio checkpoint.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="JSON or TOML file of TrainConfig fields (applied after the preset)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from OUT/last/")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction)
        elif f.name == "preset":
            p.add_argument(flag, choices=sorted(PRESETS))
        else:
            p.add_argument(flag, type={"int": int, "float": float, "str": str}[f.type])
    return p


def _load_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise TrainError(f"--config file not found: {p}")
    try:
        values = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrainError(f"--config {p}: {e}") from None
    if not isinstance(values, dict):
        raise TrainError(f"--config {p}: expected an object of TrainConfig fields, got {type(values).__name__}")
    types = {f.name: f.type for f in fields(TrainConfig)}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise TrainError(f"--config {p}: unknown fields {unknown}")
    for name, value in values.items():
        # bool is an int subclass: accept it only where the field is bool; an int is a fine float
        want = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}[types[name]]
        if not isinstance(value, want) or (isinstance(value, bool) and types[name] != "bool"):
            raise TrainError(f"--config {p}: {name} must be of type {types[name]}, got {value!r}")
        if types[name] == "float":
            values[name] = float(value)
    return values


def resolve_config(argv: list[str] | None = None) -> tuple[TrainConfig, bool]:
    """Preset, then config file, then flags; with --resume the saved run's config, then flags."""
    args = vars(build_parser().parse_args(argv))
    resume = bool(args.pop("resume", False))
    config_file = args.pop("config", None)
    values: dict[str, Any] = {}
    if resume:
        out = args.get("out")
        if not out:
            raise TrainError("--resume needs --out, the directory of the run to continue")
        last = last_dir(Path(out))
        try:
            saved = read_training(last)["train_config"]
        except (CheckpointError, AdapterError, KeyError) as e:
            raise TrainError(f"cannot resume from {last}: {e}") from None
        # a time box applies to the run that set it, not to resumes; so does deleting the run before it
        values.update(saved, stop_after=0, overwrite=False)
    else:
        preset = args.get("preset") or (config_file and _load_config_file(config_file).get("preset"))
        if preset:
            if preset not in PRESETS:
                raise TrainError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
            values.update(PRESETS[preset], preset=preset)
    given = dict(_load_config_file(config_file)) if config_file else {}
    given.update(args)
    values.update(given)
    if values.get("init_from"):
        shape = [name for name in SHAPE_FIELDS if name in given]
        if shape:
            flag = "--" + shape[0].replace("_", "-")
            raise TrainError(f"{flag} cannot be set with --init-from: the shape and tokenizer are those of "
                             f"{values['init_from']}; drop {flag}")
    return TrainConfig(**values), resume


def lora_config(cfg: TrainConfig) -> LoRAConfig:
    """The adapter a --lora run trains, its settings checked, naming the flag."""
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    for flag, ok, want in (("--lora-rank", cfg.lora_rank >= 1, "at least 1"),
                           ("--lora-alpha", cfg.lora_alpha > 0, "greater than 0"),
                           ("--lora-dropout", 0 <= cfg.lora_dropout < 1, "in [0, 1)"),
                           ("--lora-targets", bool(targets) and set(targets) <= set(TARGETS),
                            f"a comma-separated list of {', '.join(TARGETS)}")):
        if not ok:
            raise TrainError(f"{flag} must be {want}, got {getattr(cfg, flag[2:].replace('-', '_'))!r}")
    return LoRAConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets)


def check_config(cfg: TrainConfig, resume: bool = False) -> None:
    if not cfg.data:
        raise TrainError("--data is required: the text file to train on")
    if not cfg.out:
        raise TrainError("--out is required: the checkpoint directory to write")
    for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
                 "max_iters", "eval_interval", "eval_iters", "log_interval"):
        if getattr(cfg, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.n_embd % cfg.n_head:
        raise TrainError(f"--n-embd ({cfg.n_embd}) must be divisible by --n-head ({cfg.n_head})")
    if not 0 <= cfg.dropout < 1:
        raise TrainError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    for f in fields(TrainConfig):
        if f.type == "float" and not math.isfinite(getattr(cfg, f.name)):
            raise TrainError(f"--{f.name.replace('_', '-')} must be a finite number, got {getattr(cfg, f.name)}")
    if cfg.learning_rate <= 0 or cfg.min_lr < 0:
        raise TrainError("--learning-rate must be > 0 and --min-lr >= 0")
    if cfg.data_format not in DATA_FORMATS:
        raise TrainError(f"--data-format must be one of {', '.join(DATA_FORMATS)}, got {cfg.data_format!r}")
    if cfg.lora:
        if not cfg.init_from:
            raise TrainError("--lora trains an adapter on a model: name it with --init-from")
        lora_config(cfg)
    try:
        check_threads(cfg.threads)
    except ValueError as e:
        raise TrainError(f"--threads {e}") from None
    out = Path(cfg.out)
    if resume and cfg.overwrite:
        raise TrainError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not (resume or cfg.overwrite):
        resumable = "continue it with --resume, or " if (out / "last").is_dir() else ""
        raise TrainError(f"--out {out} already holds a run ({', '.join(found)}): {resumable}delete it and start "
                         "afresh with --overwrite, or pick another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"  # per process: torchrun's ranks probe at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise TrainError(f"output directory {out} is not writable: {e}") from None


def check_distributed(cfg: TrainConfig, env: DistEnv) -> None:
    """What a run over `env.world_size` processes needs, checked before any process group is formed."""
    if not env.enabled:
        return
    g, w = cfg.gradient_accumulation_steps, env.world_size
    if g % w:
        fits = sorted({w * max(1, g // w), w * (g // w + 1)})
        raise TrainError(
            f"--gradient-accumulation-steps ({g}) must be divisible by the number of processes ({w}): each "
            f"rank runs its share of a step's micro-batches; use {' or '.join(map(str, fits))}"
        )
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise TrainError(f"--device {cfg.device}: a distributed run takes --device auto, cpu (gloo) or cuda "
                         "(NCCL; each rank drives cuda:LOCAL_RANK)")
