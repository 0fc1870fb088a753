"""One training run: `Trainer(cfg).run()` trains to `max_iters` (or `stop_after` more steps), evaluating,
checkpointing the best model into OUT/ and the latest into OUT/last/ as it goes; SIGTERM or Ctrl-C stops it after
the step in progress, as an early stop: that step logged, the loss curve redrawn, OUT/last/ written. Distributed
(torchrun), every rank runs a Trainer; rank 0 alone logs and writes (model/train/__main__.py's docstring tells the
whole story)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from model import distributed
from model.checkpoint import CheckpointError, load_checkpoint
from model.config import GPTConfig, machine_memory
from model.convert import ConvertError, read_model
from model.data import DataError, Dataset, prepare
from model.devices import resolve_device
from model.distributed import DistEnv, DistributedError, dist_env
from model.gpt import GPT
from model.lora.adapter import AdapterError, add_lora, load_adapter_weights, lora_modules, read_adapter
from model.tokenizer import BPETokenizer, CharTokenizer
from model.train import outputs, resume
from model.train.config import TrainConfig, TrainError, check_config, check_distributed, lora_config
from model.train.instructions import IGNORE_INDEX, InstructionDataset, is_jsonl, prepare_instructions
from model.train.optim import configure_optimizer, get_lr

# training memory per parameter: float32 weights, gradients and AdamW's two moments
TRAIN_BYTES_PER_PARAM = 16
# the signals that stop a run after the step in progress (a second one does what it did before: Ctrl-C interrupts)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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



def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), over the targets that are not IGNORE_INDEX
    (instruction data's context and padding), in float32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE_INDEX)


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
            outputs.delete_run(self.out)
        if self.dist.enabled:
            distributed.init(self.dist, self.device)
        base = self._load_base()  # --init-from: the model, its tokenizer and where it came from
        if base is not None:  # the run's shape and tokenizer are the base's (resolve_config refused others)
            shape = base[0].config
            self.cfg = cfg = dataclasses.replace(
                cfg, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd, block_size=shape.block_size,
                bias=shape.bias, tokenizer="char" if isinstance(base[1], CharTokenizer) else "gpt2")
        self.lora = lora_config(cfg) if cfg.lora else None
        self.ds: Dataset | InstructionDataset = self._prepare_data(base[1] if base else cfg.tokenizer)
        # micro-batches per step on this rank; the step's global batch is the same whatever the world size
        self.accum_steps = cfg.gradient_accumulation_steps // self.dist.world_size
        vocab = self.ds.tokenizer.n_vocab
        vocab_size = vocab if cfg.tokenizer == "char" else (vocab + 63) // 64 * 64  # pad BPE for speed
        self.model_config = GPTConfig(
            block_size=cfg.block_size, vocab_size=base[0].config.vocab_size if base else vocab_size,
            n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
        )
        self._check_memory()
        torch.manual_seed(cfg.seed)
        self.model = GPT(self.model_config)
        self.base_record: dict[str, Any] | None = None
        if base is not None:
            self.model.load_state_dict(base[0].state_dict())
            self.base_record = {**base[2], "config": base[0].config.to_dict()}
            del base
        if self.lora is not None:  # the base frozen, the adapters' A drawn from the seeded stream
            add_lora(self.model, self.lora)
        self.model.to(self.device)
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
        self.stop_signal: int | None = None  # the signal that asked the run to stop (STOP_SIGNALS), if one did
        if resume:
            self._load_resume()
        self._wrap_forward()

    def _wrap_forward(self) -> None:
        """The forward passes: bf16 autocast on CUDA, `torch.compile` if asked, DDP for training if distributed."""
        self.autocast = (
            torch.autocast(device_type="cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda" else nullcontext()
        )
        self.eval_fwd = torch.compile(self.model) if self.cfg.compile else self.model
        self.fwd = self.eval_fwd
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.fwd = DistributedDataParallel(
                self.eval_fwd, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )

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

    def _load_base(self) -> tuple[GPT, CharTokenizer | BPETokenizer, dict[str, Any]] | None:
        """The --init-from model (model/convert.py's `read_model`), or None."""
        if not self.cfg.init_from:
            return None
        try:
            return read_model(self.cfg.init_from, bpe_dir=self.cfg.bpe_dir or None)
        except ConvertError as e:
            raise TrainError(f"--init-from: {e}") from None

    def _prepare_data(self, tokenizer: str | CharTokenizer | BPETokenizer) -> Dataset | InstructionDataset:
        """Instructions (JSONL) are read into memory; text is tokenized into `OUT/data/`. Distributed: rank 0
        writes the cache first, then the first process of every other machine (a cache hit on a shared disk), then
        everyone else reads it."""
        cfg = self.cfg
        jsonl = cfg.data_format == "jsonl" or (cfg.data_format == "auto" and is_jsonl(cfg.data))

        def load() -> Dataset | InstructionDataset:
            if jsonl:
                return prepare_instructions(cfg.data, tokenizer=tokenizer, block_size=cfg.block_size,
                                            bpe_dir=cfg.bpe_dir or None)
            return prepare(cfg.data, self.out / "data", tokenizer=tokenizer, bpe_dir=cfg.bpe_dir or None,
                           block_size=cfg.block_size)

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
        last = resume.last_dir(self.out, resume.RESUME_FILE)
        if self.lora is not None:  # the adapter onto the base, which --init-from loaded again
            try:
                load_adapter_weights(lora_modules(self.model), read_adapter(last), str(last))
            except AdapterError as e:
                raise TrainError(f"cannot resume: {e}") from None
        else:
            try:
                ck = load_checkpoint(last, device=self.device)
            except CheckpointError as e:
                raise TrainError(f"cannot resume: {e}") from None
            if ck.config != self.model_config:
                raise TrainError(f"cannot resume: {last} holds a model of config {ck.config}, "
                                 f"this run's is {self.model_config}")
            self.model.load_state_dict(ck.model.state_dict())
        state = resume.load_state(last, self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        # the RNG streams: rank 0's at the top level (what a single process saves), every rank's under "ranks"
        ranks = state.get("ranks") or [state]
        if len(ranks) != self.dist.world_size and self.is_main:
            print(f"warning: {last} was written by a run of {len(ranks)} process(es), this one has "
                  f"{self.dist.world_size}: training continues, but on other batches than an uninterrupted run",
                  file=sys.stderr)
        if self.dist.rank < len(ranks):
            resume.set_rng_state(ranks[self.dist.rank], self.batch_gen, self.device)
        self.step = state["step"]
        self.best_val = state["best_val"]
        self.tokens_seen = state["tokens_seen"]
        self.wall_time = state["wall_time"]
        if self.is_main:
            outputs.truncate_metrics(self.out, self.step)

    # -- bookkeeping ----------------------------------------------------------------------------------
    def provenance(self, train_loss: float | None, val_loss: float | None) -> dict[str, Any]:
        base = {"base": self.base_record} if self.base_record else {}
        return {
            **base,
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

    @torch.no_grad()
    def estimate_loss(self) -> dict[str, float]:
        """Mean loss over `eval_iters` batches per split; the same batches every time (own generator).

        Distributed, every rank draws all the batches but evaluates only every world_size-th one, from its
        rank on; summing the ranks' loss vectors (each entry nonzero on one rank only, so the sum is exact)
        gives every rank the single-process mean over the same batches."""
        self.model.eval()
        out = {}
        rank, world = self.dist.rank, self.dist.world_size
        for split in ("train", "val"):
            gen = torch.Generator().manual_seed(self.cfg.seed + 1)
            losses = torch.zeros(self.cfg.eval_iters)
            for k in range(self.cfg.eval_iters):
                x, y = self.ds.batch(split, self.cfg.batch_size, self.cfg.block_size, gen, self.device)
                if k % world != rank:
                    continue
                with self.autocast:
                    logits = self.eval_fwd(x)
                losses[k] = lm_loss(logits, y).item()
            if self.dist.enabled:
                losses = distributed.all_reduce_sum(losses, self.device)
            out[split] = losses.mean().item()
        self.model.train()
        return out

    def save_last(self, losses: dict[str, float] | None) -> None:
        """Swap in a complete `last/` (weights, config, resume state). Distributed, every rank hands its RNG
        streams to rank 0, which alone writes."""
        mine = resume.rng_state(self.batch_gen, self.device)
        ranks = distributed.gather(mine) if self.dist.enabled else None
        if not self.is_main:
            return
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), **mine, "best_val": self.best_val,
                 "tokens_seen": self.tokens_seen, "wall_time": self.wall_time}
        if ranks is not None:
            state["ranks"] = ranks
        training = self.provenance(*((losses["train"], losses["val"]) if losses else (None, None)))
        resume.write_last(self.out, self.model, self.ds.tokenizer, training, state, self.lora)

    # -- the loop -------------------------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next training micro-batch: inputs and targets, (B, T) each."""
        cfg = self.cfg
        return self.ds.batch("train", cfg.batch_size, cfg.block_size, self.batch_gen, self.device)

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
                    loss = lm_loss(logits, y)
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
            outputs.log_metrics(self.out, {"step": self.step, "train_loss": losses["train"], "val_loss": losses["val"]})
            outputs.plot_metrics(self.out / outputs.METRICS_FILE, self.out / outputs.PLOT_FILE)
        if losses["val"] < self.best_val:
            self.best_val = losses["val"]
            if self.is_main:
                resume.save_model(self.out, self.model, self.ds.tokenizer,
                                  self.provenance(losses["train"], losses["val"]), self.lora)
        return losses

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """Within the block a STOP_SIGNALS signal sets `stop_signal` (the loop stops after the step in progress);
        a second one does what the first would have done. In the main thread only, where Python runs handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        def stop(signum: int, _frame: object) -> None:
            self.stop_signal = signum
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        for sig in STOP_SIGNALS:
            signal.signal(sig, stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stopping(self) -> bool:
        """Whether a signal asked this run (any rank of it: they stop at the same step) to stop."""
        asked = self.stop_signal is not None
        return distributed.any_rank(asked, self.device) if self.dist.enabled else asked

    def run(self) -> dict[str, Any]:
        """Train to `max_iters` (or `stop_after` more steps, or until SIGTERM or Ctrl-C), then evaluate at the end
        of the run or, stopped early, redraw the loss curve; write OUT/last/ either way. The summary's
        `stopped_by` names the signal that stopped it early, if one did."""
        with self._stop_on_signals():
            return self._run()

    def _run(self) -> dict[str, Any]:
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
            if self._stopping():  # this step is the last: logged below, then the curve and last/
                end = self.step
            if self.step % cfg.log_interval == 0 or self.step == end:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t_log
                tps = tok_log / dt
                t_log, tok_log = time.perf_counter(), 0
                if self.dist.enabled:  # the global batch's mean loss, as one process would log it
                    loss = distributed.mean_over_ranks(loss, self.device)
                if self.is_main:
                    outputs.log_metrics(self.out, {"step": self.step, "loss": loss, "lr": lr, "tokens_per_s": tps})
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            bar.update(1)
        bar.close()
        if self.step >= cfg.max_iters:  # the run is complete: final evaluation (which redraws the loss curve)
            losses = self.evaluate_and_save()
            if self.is_main:
                print(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                      file=sys.stderr)
        elif self.is_main:  # stopped early (--stop-after, a signal): the curve up to the last step logged
            outputs.plot_metrics(self.out / outputs.METRICS_FILE, self.out / outputs.PLOT_FILE)
        self.save_last(losses)
        stopped_by = None
        if self.stop_signal is not None and self.step < cfg.max_iters:
            stopped_by = signal.Signals(self.stop_signal).name
            if self.is_main:
                print(f"stopped by {stopped_by} at step {self.step}: {self.out / 'last'} holds it, --resume "
                      f"continues", file=sys.stderr)
        return {"step": self.step, "best_val": self.best_val, "losses": losses, "wall_time_s": self.wall_time,
                "tokens_seen": self.tokens_seen, "stopped_by": stopped_by}

