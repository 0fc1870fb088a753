"""The offline train module: `python -m model.train` turns a text file into a Folio checkpoint.

    python -m model.train --preset shakespeare-char-cpu --data input.txt --out weights/my-model

Every `TrainConfig` field is a flag in kebab case (`--max-iters 2000`); values come from the preset, then a
`--config` file (JSON or TOML), then flags. `--resume` continues a run exactly (step, optimizer, RNG,
schedule) from `OUT/last/`. The best-validation model is written to `OUT/` itself (what the server loads);
`OUT/last/` holds the latest periodic checkpoint plus `resume.pt`. Metrics go to `OUT/metrics.jsonl` and the
loss curve to `OUT/loss.png` (redrawn at every evaluation). A run never starts over another one in `OUT`:
`--resume` continues it, `--overwrite` deletes it first (the tokenized text in `OUT/data/` is kept).

Distributed data parallel: `torchrun --nproc_per_node=N -m model.train ...` runs N processes (gloo on CPU,
NCCL on CUDA, one GPU per process: `cuda:LOCAL_RANK`). `--gradient-accumulation-steps` stays the global
number of micro-batches per step and is split across the ranks, so a step sees the same number of tokens
whatever N is. Rank r draws its micro-batches from its own stream (seed + r); gradients are all-reduced on
each rank's last micro-step only; evaluation splits the evaluation batches across the ranks and sums them
back; rank 0 alone logs, shows progress and writes checkpoints and metrics. `OUT/last/resume.pt` keeps every
rank's RNG streams, so `--resume` under the same N continues exactly.
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

from model import distributed
from model.checkpoint import (
    CONFIG_FILE,
    NEXT_CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    atomic_path,
    load_checkpoint,
    read_config,
    save_checkpoint,
)
from model.cli import ArgumentParser, check_threads
from model.config import GPTConfig, machine_memory
from model.data import DataError, Dataset, get_batch, prepare
from model.devices import resolve_device
from model.distributed import DistEnv, DistributedError, dist_env
from model.gpt import GPT
from model.tokenizer import BPE_FILE

RESUME_FILE = "resume.pt"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
# what a run leaves in OUT; OUT/data/ (the tokenized text, reused by any run on the same text) is not the run's
RUN_FILES = (CONFIG_FILE, NEXT_CONFIG_FILE, WEIGHTS_FILE, BPE_FILE, METRICS_FILE, PLOT_FILE, "last", "last.old",
             "last.tmp")
# training memory per parameter: float32 weights, gradients and AdamW's two moments
TRAIN_BYTES_PER_PARAM = 16


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
        last = Path(out) / "last"
        if not last.is_dir() and (Path(out) / "last.old").is_dir():
            last = Path(out) / "last.old"  # a crash hit between the two renames of a checkpoint swap
        try:
            saved = read_config(last)["training"]["train_config"]
        except (CheckpointError, KeyError) as e:
            raise TrainError(f"cannot resume from {last}: {e}") from None
        # a time box applies to the run that set it, not to resumes; so does deleting the run before it
        values.update(saved, stop_after=0, overwrite=False)
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


def pick_device(name: str, local_rank: int | None = None) -> torch.device:
    """The device to train on; under torchrun (`local_rank` given) CUDA means this rank's own GPU."""
    try:
        dev = resolve_device(name, kinds=("cpu", "cuda", "mps"))
    except ValueError as e:
        raise TrainError(str(e)) from None
    if local_rank is not None and dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise TrainError(f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                             "start at most that many processes per node (--nproc_per_node)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
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

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, env: DistEnv | None = None) -> None:
        check_config(cfg, resume)
        try:
            self.dist = env or dist_env()
        except DistributedError as e:
            raise TrainError(str(e)) from None
        check_distributed(cfg, self.dist)
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.is_main = self.dist.is_main
        self.device = pick_device(cfg.device, self.dist.local_rank if self.dist.enabled else None)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.overwrite and self.is_main:
            self._delete_run()
        if self.dist.enabled:
            distributed.init(self.dist, self.device)
        self.ds: Dataset = self._prepare_data()
        # micro-batches per step on this rank; the step's global batch is the same whatever the world size
        self.accum_steps = cfg.gradient_accumulation_steps // self.dist.world_size
        vocab = self.ds.tokenizer.n_vocab
        vocab_size = vocab if cfg.tokenizer == "char" else (vocab + 63) // 64 * 64  # pad BPE for speed
        self.model_config = GPTConfig(
            block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
        )
        self._check_memory()
        torch.manual_seed(cfg.seed)
        self.model = GPT(self.model_config).to(self.device)
        self.optimizer = configure_optimizer(self.model, cfg, self.device)
        # rank r draws batches from stream seed + r (rank 0, and a single process, from seed itself); ranks
        # after 0 also get their own dropout stream, rank 0 keeps the single-process one
        self.batch_gen = torch.Generator().manual_seed(cfg.seed + self.dist.rank)
        if self.dist.rank > 0:
            torch.manual_seed(cfg.seed + self.dist.rank)
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
        self.eval_fwd = torch.compile(self.model) if cfg.compile else self.model
        self.fwd = self.eval_fwd
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.fwd = DistributedDataParallel(
                self.eval_fwd, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )

    def _delete_run(self) -> None:
        """--overwrite: the run already in OUT goes, so that its checkpoints and metrics never mix with this one's."""
        for name in RUN_FILES:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def _check_memory(self) -> None:
        """Refuse a run whose weights, gradients, optimizer state and one micro-batch's logits alone (a lower bound)
        exceed the device's memory, before building anything: a mistyped --n-layer, --n-embd or --batch-size would
        otherwise fail deep in an allocation, or after minutes spent building layers or drawing the batch."""
        memory = (torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda"
                  else machine_memory())
        b, t, config = self.cfg.batch_size, self.cfg.block_size, self.model_config
        purpose = f"training it (weights, gradients, AdamW's state and the logits of a {b}x{t} batch, in float32)"
        try:
            config.check_memory(TRAIN_BYTES_PER_PARAM, memory, purpose, extra_bytes=b * t * config.vocab_size * 4)
        except ValueError as e:
            raise TrainError(str(e)) from None

    def _prepare_data(self) -> Dataset:
        """Tokenize the text into `OUT/data/`. Distributed: rank 0 writes the cache first, then the first
        process of every other machine (a cache hit on a shared disk), then everyone else reads it."""

        def load() -> Dataset:
            return prepare(self.cfg.data, self.out / "data", tokenizer=self.cfg.tokenizer,
                           bpe_dir=self.cfg.bpe_dir or None, block_size=self.cfg.block_size)

        if not self.dist.enabled:
            return load()
        ds, error = None, None
        for my_turn in (self.dist.rank == 0, self.dist.local_rank == 0, True):
            if my_turn and ds is None and error is None:
                try:
                    ds = load()
                except DataError as e:
                    error = e
            if distributed.any_rank(error is not None, self.device):  # also the barrier between turns
                raise error or DataError("another rank could not prepare the data; its error says why")
        assert ds is not None
        return ds

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
        # the RNG streams: rank 0's at the top level (what a single process saves), every rank's under "ranks"
        ranks = state.get("ranks") or [state]
        if len(ranks) != self.dist.world_size and self.is_main:
            print(f"warning: {last} was written by a run of {len(ranks)} process(es), this one has "
                  f"{self.dist.world_size}: training continues, but on other batches than an uninterrupted run",
                  file=sys.stderr)
        if self.dist.rank < len(ranks):
            self._set_rng_state(ranks[self.dist.rank])
        self.step = state["step"]
        self.best_val = state["best_val"]
        self.tokens_seen = state["tokens_seen"]
        self.wall_time = state["wall_time"]
        if self.is_main:
            self._truncate_metrics(self.step)

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"torch_rng": torch.get_rng_state(), "batch_rng": self.batch_gen.get_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch_rng"].cpu())
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)
        self.batch_gen.set_state(state["batch_rng"].cpu())

    def _truncate_metrics(self, step: int) -> None:
        """Drop what was logged after the checkpoint at `step`. The training row for `step` was logged
        before that checkpoint and is kept; an evaluation at `step` is dropped, since the resumed loop
        evaluates `step` again (same weights, same eval batches, so the same row comes back)."""
        path = self.out / METRICS_FILE
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
            "world_size": self.dist.world_size,
            "train_config": dataclasses.asdict(self.cfg),
        }

    def _log(self, record: dict[str, Any]) -> None:
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    @torch.no_grad()
    def estimate_loss(self) -> dict[str, float]:
        """Mean loss over `eval_iters` batches per split; the same batches every time (own generator).

        Distributed, every rank draws all the batches but evaluates only every world_size-th one, from its
        rank on; summing the ranks' loss vectors (each entry nonzero on one rank only, so the sum is exact)
        gives every rank the single-process mean over the same batches."""
        self.model.eval()
        out = {}
        rank, world = self.dist.rank, self.dist.world_size
        for split, data in (("train", self.ds.train), ("val", self.ds.val)):
            gen = torch.Generator().manual_seed(self.cfg.seed + 1)
            losses = torch.zeros(self.cfg.eval_iters)
            for k in range(self.cfg.eval_iters):
                x, y = get_batch(data, self.cfg.batch_size, self.cfg.block_size, gen, self.device)
                if k % world != rank:
                    continue
                with self.autocast:
                    logits = self.eval_fwd(x)
                losses[k] = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)).item()
            if self.dist.enabled:
                losses = distributed.all_reduce_sum(losses, self.device)
            out[split] = losses.mean().item()
        self.model.train()
        return out

    def save_last(self, losses: dict[str, float] | None) -> None:
        """Swap in a complete `last/` (weights, config, resume state): write `last.tmp/`, then rename.
        Distributed, every rank hands its RNG streams to rank 0, which alone writes."""
        ranks = distributed.gather(self._rng_state()) if self.dist.enabled else None
        if not self.is_main:
            return
        tmp, last, old = self.out / "last.tmp", self.out / "last", self.out / "last.old"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(tmp, self.model, self.ds.tokenizer,
                        training=self.provenance(*((losses["train"], losses["val"]) if losses else (None, None))))
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
        if ranks is not None:
            state["ranks"] = ranks
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
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next training micro-batch: inputs and targets, (B, T) each."""
        cfg = self.cfg
        return get_batch(self.ds.train, cfg.batch_size, cfg.block_size, self.batch_gen, self.device)

    def train_step(self, lr: float) -> float:
        """One optimizer step over `accum_steps` micro-batches; returns this rank's mean micro-batch loss.

        Each micro-batch's loss is divided by the micro-batches of this rank; DDP averages the gradients over
        the ranks, so the step's gradient is the mean over the whole global batch, as in one process."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(self.accum_steps):
            x, y = self.next_batch()
            # DDP all-reduces gradients during backward: only on this step's last micro-batch
            last = micro == self.accum_steps - 1
            with nullcontext() if last or not self.dist.enabled else self.fwd.no_sync():
                with self.autocast:
                    logits = self.fwd(x)
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                (loss / self.accum_steps).backward()
            loss_sum += loss.item()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / self.accum_steps

    def evaluate_and_save(self) -> dict[str, float]:
        losses = self.estimate_loss()  # every rank gets the same numbers, so every rank tracks best_val
        if self.is_main:
            self._log({"step": self.step, "train_loss": losses["train"], "val_loss": losses["val"]})
            plot_metrics(self.out / METRICS_FILE, self.out / PLOT_FILE)
        if losses["val"] < self.best_val:
            self.best_val = losses["val"]
            if self.is_main:
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
        bar = tqdm(total=cfg.max_iters, initial=self.step, disable=not (cfg.progress and self.is_main), unit="step",
                   dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
        losses: dict[str, float] | None = None
        t_log, tok_log = time.perf_counter(), 0
        while self.step < end:
            t0 = time.perf_counter()
            if self.step % cfg.eval_interval == 0 and self.step > 0:
                losses = self.evaluate_and_save()
                if self.is_main:
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
                if self.dist.enabled:  # the global batch's mean loss, as one process would log it
                    loss = distributed.mean_over_ranks(loss, self.device)
                if self.is_main:
                    self._log({"step": self.step, "loss": loss, "lr": lr, "tokens_per_s": tps})
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            bar.update(1)
        bar.close()
        if self.step >= cfg.max_iters:  # the run is complete: final evaluation (which redraws the loss curve)
            losses = self.evaluate_and_save()
            if self.is_main:
                print(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                      file=sys.stderr)
        elif self.is_main:  # stopped early (--stop-after): the curve up to the last step logged
            plot_metrics(self.out / METRICS_FILE, self.out / PLOT_FILE)
        self.save_last(losses)
        return {"step": self.step, "best_val": self.best_val, "losses": losses, "wall_time_s": self.wall_time,
                "tokens_seen": self.tokens_seen}


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
