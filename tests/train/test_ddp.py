"""Distributed data-parallel training: `torchrun --nproc_per_node=2 -m model.train` on CPU (gloo) against one
process that draws the same global batch.

Rank r draws its micro-batches from stream seed + r, so a 2-rank run does not see the batches a single process
with the same seed sees. The reference is therefore one process whose step draws the first half of its
micro-batches from stream seed and the second half from stream seed + 1: the same global batch, the same
initial weights, the same learning rates. What is then equal:

- one micro-batch per rank (2 in all): bit for bit. One process accumulates g0/2 + g1/2; DDP sums g0 and g1
  and divides by 2. Halving is exact in floating point and a sum of two terms does not depend on its order.
- two micro-batches per rank (4 in all): equal up to rounding. One process sums ((a + b) + c) + d, DDP sums
  (a + b) + (c + d); the tolerance below bounds that.

Every run is tiny (one layer, 32 wide, a 20 KB text, 20 steps); each torchrun launch takes 10-20 s (process
start-up and gloo rendezvous, mostly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint
from model.data import get_batch
from model.distributed import DistEnv, dist_env
from model.lora.adapter import ADAPTER_WEIGHTS_FILE
from model.reference import generate_naive
from model.sampling_params import SamplingParams
from model.train.__main__ import main
from model.train.config import TrainError, resolve_config
from model.train.trainer import Trainer
from tests import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WORLD = 2
STEPS = 20
# rounding-level differences from summing four micro-batch gradients in another order: observed ~2e-7 on the
# losses and ~1e-7 on the weights after 20 steps; a wrong batch, a missing all-reduce or a wrong divisor moves
# the loss by 1e-2 or more (the last test checks that a run on other batches is that far away)
TOLERANCE = 1e-5

# one layer, 32 wide; evaluation and checkpoints every 10 steps over 3 batches (split 2 + 1 across the ranks)
SHAPE = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]  # a base's under --init-from
TINY = [
    *SHAPE, "--batch-size", "8", "--dropout", "0", "--learning-rate", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "5",
    "--eval-interval", "10", "--eval-iters", "3", "--log-interval", "5", "--device", "cpu", "--no-progress",
    "--max-iters", str(STEPS),
]


def argv(text: Path, out: Path, accumulation: int, *extra: str) -> list[str]:
    """A tiny run's flags; with --init-from among `extra`, without the shape flags (the base's)."""
    tiny = TINY[len(SHAPE):] if "--init-from" in extra else TINY
    return ["--data", str(text), "--out", str(out), *tiny, "--gradient-accumulation-steps", str(accumulation),
            *extra]


def torchrun(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           "-m", "model.train", *args]
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


class SameBatchesAsTwoRanks(Trainer):
    """One process whose step draws the global batch of a 2-rank run: the first half of its micro-batches
    from rank 0's stream (seed), the second half from rank 1's (seed + 1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams = [torch.Generator().manual_seed(self.cfg.seed + r) for r in range(WORLD)]
        self.micro = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.cfg.gradient_accumulation_steps // WORLD
        stream = self.streams[(self.micro % self.cfg.gradient_accumulation_steps) // per_rank]
        self.micro += 1
        return get_batch(self.ds.train, self.cfg.batch_size, self.cfg.block_size, stream, self.device)


def reference(text: Path, out: Path, accumulation: int, trainer: type[Trainer] = SameBatchesAsTwoRanks,
              *extra: str) -> Path:
    """A single-process run in this process, on one thread like the torchrun workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, _ = resolve_config(argv(text, out, accumulation, *extra))
        trainer(cfg).run()
    finally:
        torch.set_num_threads(threads)
    return out


def metrics(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without throughput (which no rerun reproduces)."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def ddp_run(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks x 2 micro-batches (global accumulation 4), uninterrupted."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    torchrun(argv(text_file, out, 4))
    return out


# -- against one process ------------------------------------------------------------------------------


def test_two_ranks_match_one_process_on_the_same_global_batch(
    ddp_run: Path, text_file: Path, tmp_path: Path
) -> None:
    """Accumulation 4 over 2 ranks (no_sync on each rank's first micro-batch) = one process accumulating the
    same 4 micro-batches, up to the order the gradient sum is taken in: every logged loss, learning rate and
    evaluation, and the final weights, within TOLERANCE. Rank 0 alone writes metrics: no duplicate rows."""
    ref = reference(text_file, tmp_path / "ref", 4)
    got, want = metrics(ddp_run), metrics(ref)
    assert [(r["step"], sorted(r)) for r in got] == [(r["step"], sorted(r)) for r in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "train_loss", "val_loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=TOLERANCE), (g, w)
        assert g.get("lr") == w.get("lr")
    assert max_weight_difference(ddp_run / "last", ref / "last") <= TOLERANCE


def test_the_tolerance_tells_other_batches_apart(ddp_run: Path, text_file: Path, tmp_path: Path) -> None:
    """A plain single process (all 4 micro-batches from stream seed) trains on other batches; its losses are
    far outside TOLERANCE, so the comparison above would catch a rank reading the wrong stream."""
    plain = reference(text_file, tmp_path / "plain", 4, trainer=Trainer)
    last_ddp, last_plain = metrics(ddp_run)[-1], metrics(plain)[-1]
    assert abs(last_ddp["val_loss"] - last_plain["val_loss"]) > 100 * TOLERANCE, (last_ddp, last_plain)


def test_resumed_ddp_run_is_bit_exact(text_file: Path, tmp_path: Path) -> None:
    """One micro-batch per rank, stopped after 10 steps and resumed under torchrun (every rank loads
    last/ and its own RNG streams): the weights and metrics equal, bit for bit, one process that
    accumulated the same two micro-batches for 20 steps uninterrupted."""
    out = tmp_path / "resumed"
    torchrun(argv(text_file, out, 2, "--stop-after", "10"))
    state = torch.load(out / "last" / "resume.pt", weights_only=True)
    assert state["step"] == 10 and len(state["ranks"]) == WORLD
    assert not torch.equal(state["ranks"][0]["batch_rng"], state["ranks"][1]["batch_rng"])
    torchrun(["--resume", "--out", str(out)])
    ref = reference(text_file, tmp_path / "ref", 2)
    assert metrics(out) == metrics(ref)
    for name in ("last", "."):  # the latest and the best-validation checkpoint
        assert max_weight_difference(out / name, ref / name) == 0.0


def test_a_lora_run_on_two_ranks_matches_one_process(ddp_run: Path, text_file: Path, tmp_path: Path) -> None:
    """`--init-from` a base with `--lora` under torchrun (one micro-batch per rank; only the adapter's parameters
    have gradients for DDP to reduce): the adapter and the metrics equal, bit for bit, one process accumulating the
    same two micro-batches; the base is not written, the adapter moved from its start."""
    lora = ("--init-from", str(ddp_run), "--lora", "--lora-rank", "4", "--lora-targets", "c_attn,c_fc",
            "--learning-rate", "1e-2")
    out = tmp_path / "lora"
    torchrun(argv(text_file, out, 2, *lora))
    ref = reference(text_file, tmp_path / "ref", 2, SameBatchesAsTwoRanks, *lora)
    assert metrics(out) == metrics(ref)
    got, want = (load_file(d / "last" / ADAPTER_WEIGHTS_FILE) for d in (out, ref))
    assert sorted(got) == sorted(want) and len(got) == 2 * 2  # A and B of c_attn and c_fc in the one layer
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert all(got[k].abs().max() > 0 for k in got if "lora_B" in k)  # B starts at zero: it trained
    assert not (out / "last" / "model.safetensors").exists()


# -- the checkpoint -------------------------------------------------------------------------------------


def test_ddp_checkpoint_loads_and_generates(ddp_run: Path) -> None:
    """Rank 0's checkpoint is an ordinary Folio checkpoint: it loads, records the world size, generates."""
    ck = load_checkpoint(ddp_run)
    assert ck.training["world_size"] == WORLD and ck.training["steps"] == STEPS
    assert ck.training["tokens_seen"] == STEPS * 4 * 8 * 32  # the global batch: 4 micro-batches of 8 x 32
    prompt = ck.tokenizer.encode("ROMEO:")
    params = SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.8, seed=1)
    tokens = [t for t, _ in generate_naive(ck.model.eval(), prompt, params, n_vocab=ck.tokenizer.n_vocab)]
    assert len(tokens) == 16 and all(0 <= t < ck.tokenizer.n_vocab for t in tokens)
    assert isinstance(ck.tokenizer.decode(tokens), str)


# -- launch errors, before any process group ----------------------------------------------------------


def test_accumulation_must_divide_across_ranks(text_file: Path, tmp_path: Path) -> None:
    cfg, _ = resolve_config(argv(text_file, tmp_path / "x", 3))
    with pytest.raises(TrainError, match=r"\(3\) must be divisible by the number of processes \(2\).*2 or 4"):
        Trainer(cfg, env=DistEnv(rank=0, local_rank=0, world_size=2))


def test_torchrun_environment_is_read_and_checked(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dist_env({}) == DistEnv(0, 0, 1)
    assert dist_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == DistEnv(3, 1, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")  # no RANK: not started by torchrun
    monkeypatch.delenv("RANK", raising=False)
    assert main(argv(text_file, tmp_path / "x", 2)) == 2
    assert "start distributed runs with torchrun" in capsys.readouterr().err
