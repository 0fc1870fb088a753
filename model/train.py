"""The offline train module: `python -m model.train` turns a text file into a Folio checkpoint.

    python -m model.train --preset shakespeare-char-cpu --data input.txt --out weights/my-model

Every `TrainConfig` field is a flag in kebab case (`--max-iters 2000`); values come from the preset, then a
`--config` file (JSON or TOML), then flags. `--resume` continues a run exactly (step, optimizer, RNG,
schedule) from `OUT/last/`. The best-validation model is written to `OUT/` itself (what the server loads);
`OUT/last/` holds the latest periodic checkpoint plus `resume.pt`. Metrics go to `OUT/metrics.jsonl` and the
loss curve to `OUT/loss.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import tomllib
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from model.checkpoint import CheckpointError, load_checkpoint, read_config, save_checkpoint
from model.config import GPTConfig
from model.data import DataError, Dataset, get_batch, prepare
from model.gpt import GPT

RESUME_FILE = "resume.pt"


@dataclass
class TrainConfig:
    data: str = ""
    out: str = ""
    preset: str = ""
    tokenizer: str = "char"  # 'char' (vocabulary from the text) or 'gpt2' (BPE)
    bpe_dir: str = ""  # folder with GPT-2's vocab.bpe + encoder.json; empty: $FOLIO_GPT2_BPE_DIR or download
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
    # Folio's bundled default (weights/shakespeare-char): sized to reach val loss < 1.60 in about an hour
    # on two CPU cores; no dropout, since it sees each character only ~15 times
    "shakespeare-char-small": dict(
        n_layer=6, n_head=6, n_embd=192, block_size=128, batch_size=32, dropout=0.0, learning_rate=2e-3,
        min_lr=2e-4, max_iters=4000, lr_decay_iters=4000, warmup_iters=100, beta2=0.99, eval_interval=500,
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


class TrainError(ValueError):
    """A training setup that cannot run; raised before any training step."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
        last = Path(out) / "last"
        if not last.is_dir() and (Path(out) / "last.old").is_dir():
            last = Path(out) / "last.old"  # a crash hit between the two renames of a checkpoint swap
        try:
            saved = read_config(last)["training"]["train_config"]
        except (CheckpointError, KeyError) as e:
            raise TrainError(f"cannot resume from {last}: {e}") from None
        values.update(saved, stop_after=0)  # a time box applies to the run that set it, not to resumes
    else:
        preset = args.get("preset") or (config_file and _load_config_file(config_file).get("preset"))
        if preset:
            if preset not in PRESETS:
                raise TrainError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
            values.update(PRESETS[preset], preset=preset)
    if config_file:
        values.update(_load_config_file(config_file))
    values.update(args)
    return TrainConfig(**values), resume


def check_config(cfg: TrainConfig) -> None:
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
    if cfg.learning_rate <= 0 or cfg.min_lr < 0:
        raise TrainError("--learning-rate must be > 0 and --min-lr >= 0")
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise TrainError(f"output directory {out} is not writable: {e}") from None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: CUDA is not available on this machine")
    return dev


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def configure_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (2D+ tensors) only; fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token (PaLM appendix B, as nanoGPT's estimate_mfu): 6N + 12 L T d."""
    n = config.num_params(non_embedding=True)
    return 6 * n + 12 * config.n_layer * config.block_size * config.n_embd


class Trainer:
    """One training run; `run()` trains to `max_iters` (or `stop_after`), checkpointing as it goes."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.device = pick_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.ds: Dataset = prepare(
            cfg.data, self.out / "data", tokenizer=cfg.tokenizer, bpe_dir=cfg.bpe_dir or None,
            block_size=cfg.block_size,
        )
        vocab = self.ds.tokenizer.n_vocab
        vocab_size = vocab if cfg.tokenizer == "char" else (vocab + 63) // 64 * 64  # pad BPE for speed
        self.model_config = GPTConfig(
            block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
        )
        torch.manual_seed(cfg.seed)
        self.model = GPT(self.model_config).to(self.device)
        self.optimizer = configure_optimizer(self.model, cfg, self.device)
        self.batch_gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.best_val = float("inf")
        self.tokens_seen = 0
        self.wall_time = 0.0
        if resume:
            self._load_resume()
        self.autocast = (
            torch.autocast(device_type="cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda" else nullcontext()
        )
        self.fwd = torch.compile(self.model) if cfg.compile else self.model

    # -- resume ---------------------------------------------------------------------------------------
    def _load_resume(self) -> None:
        last = self.out / "last"
        if not (last / RESUME_FILE).is_file() and (self.out / "last.old" / RESUME_FILE).is_file():
            last = self.out / "last.old"  # a crash hit between the two renames of a checkpoint swap
        try:
            ck = load_checkpoint(last, device=self.device)
        except CheckpointError as e:
            raise TrainError(f"cannot resume: {e}") from None
        if ck.config != self.model_config:
            raise TrainError(f"cannot resume: {last} holds a model of config {ck.config}, "
                             f"this run's is {self.model_config}")
        self.model.load_state_dict(ck.model.state_dict())
        state = torch.load(last / RESUME_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"])
        self.batch_gen.set_state(state["batch_rng"])
        self.step = state["step"]
        self.best_val = state["best_val"]
        self.tokens_seen = state["tokens_seen"]
        self.wall_time = state["wall_time"]
        self._truncate_metrics(self.step)

    def _truncate_metrics(self, step: int) -> None:
        """Drop what was logged after the checkpoint at `step`. The training row for `step` was logged
        before that checkpoint and is kept; an evaluation at `step` is dropped, since the resumed loop
        evaluates `step` again (same weights, same eval batches, so the same row comes back)."""
        path = self.out / "metrics.jsonl"
        if path.is_file():
            rows = [ln for ln in path.read_text().splitlines() if ln]
            keep = [ln for ln in rows
                    if (r := json.loads(ln))["step"] < step or (r["step"] == step and "loss" in r)]
            path.write_text("".join(ln + "\n" for ln in keep))

    # -- bookkeeping ----------------------------------------------------------------------------------
    def provenance(self, train_loss: float | None, val_loss: float | None) -> dict[str, Any]:
        return {
            "preset": self.cfg.preset or None,
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "dataset": os.path.basename(self.cfg.data),
            "dataset_sha256": self.ds.sha256,
            "wall_time_s": round(self.wall_time, 1),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device),
            "torch_version": torch.__version__,
            "train_config": dataclasses.asdict(self.cfg),
        }

    def _log(self, record: dict[str, Any]) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    @torch.no_grad()
    def estimate_loss(self) -> dict[str, float]:
        """Mean loss over `eval_iters` batches per split; the same batches every time (own generator)."""
        self.model.eval()
        out = {}
        for split, data in (("train", self.ds.train), ("val", self.ds.val)):
            gen = torch.Generator().manual_seed(self.cfg.seed + 1)
            losses = torch.zeros(self.cfg.eval_iters)
            for k in range(self.cfg.eval_iters):
                x, y = get_batch(data, self.cfg.batch_size, self.cfg.block_size, gen, self.device)
                with self.autocast:
                    logits = self.fwd(x)
                losses[k] = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)).item()
            out[split] = losses.mean().item()
        self.model.train()
        return out

    def save_last(self, losses: dict[str, float] | None) -> None:
        """Swap in a complete `last/` (weights, config, resume state): write `last.tmp/`, then rename."""
        tmp, last, old = self.out / "last.tmp", self.out / "last", self.out / "last.old"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(tmp, self.model, self.ds.tokenizer,
                        training=self.provenance(*(losses or {}).get("train", None) and
                                                 (losses["train"], losses["val"]) or (None, None)))
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "batch_rng": self.batch_gen.get_state(),
            "best_val": self.best_val,
            "tokens_seen": self.tokens_seen,
            "wall_time": self.wall_time,
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        with open(tmp / (RESUME_FILE + ".tmp"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp / (RESUME_FILE + ".tmp"), tmp / RESUME_FILE)
        shutil.rmtree(old, ignore_errors=True)
        if last.exists():
            os.replace(last, old)
        os.replace(tmp, last)
        shutil.rmtree(old, ignore_errors=True)

    # -- the loop -------------------------------------------------------------------------------------
    def train_step(self, lr: float) -> float:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(cfg.gradient_accumulation_steps):
            x, y = get_batch(self.ds.train, cfg.batch_size, cfg.block_size, self.batch_gen, self.device)
            with self.autocast:
                logits = self.fwd(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            (loss / cfg.gradient_accumulation_steps).backward()
            loss_sum += loss.item()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / cfg.gradient_accumulation_steps

    def evaluate_and_save(self) -> dict[str, float]:
        losses = self.estimate_loss()
        self._log({"step": self.step, "train_loss": losses["train"], "val_loss": losses["val"]})
        if losses["val"] < self.best_val:
            self.best_val = losses["val"]
            save_checkpoint(self.out, self.model, self.ds.tokenizer,
                            training=self.provenance(losses["train"], losses["val"]))
        return losses

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        tokens_per_step = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
        ckpt_every = cfg.checkpoint_interval or cfg.eval_interval
        end = cfg.max_iters if not cfg.stop_after else min(cfg.max_iters, self.step + cfg.stop_after)
        self.model.train()
        bar = tqdm(total=cfg.max_iters, initial=self.step, disable=not cfg.progress, unit="step",
                   dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
        losses: dict[str, float] | None = None
        t_log, tok_log = time.perf_counter(), 0
        while self.step < end:
            t0 = time.perf_counter()
            if self.step % cfg.eval_interval == 0 and self.step > 0:
                losses = self.evaluate_and_save()
                bar.write(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if self.step % ckpt_every == 0 and self.step > 0:
                self.save_last(losses)
            lr = get_lr(self.step, cfg)
            loss = self.train_step(lr)
            self.step += 1
            self.tokens_seen += tokens_per_step
            tok_log += tokens_per_step
            self.wall_time += time.perf_counter() - t0
            if self.step % cfg.log_interval == 0 or self.step == end:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t_log
                tps = tok_log / dt
                t_log, tok_log = time.perf_counter(), 0
                self._log({"step": self.step, "loss": loss, "lr": lr, "tokens_per_s": tps})
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            bar.update(1)
        bar.close()
        if self.step >= cfg.max_iters:  # the run is complete: final evaluation
            losses = self.evaluate_and_save()
            print(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                  file=sys.stderr)
        self.save_last(losses)
        plot_metrics(self.out / "metrics.jsonl", self.out / "loss.png")
        return {"step": self.step, "best_val": self.best_val, "losses": losses, "wall_time_s": self.wall_time,
                "tokens_seen": self.tokens_seen}


def plot_metrics(metrics: Path, png: Path) -> None:
    """Loss curve: training loss per log interval and evaluated train/val loss, against step."""
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
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, resume = resolve_config(argv)
        trainer = Trainer(cfg, resume=resume)
    except (TrainError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = trainer.run()
    print(json.dumps({k: v for k, v in result.items()}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
