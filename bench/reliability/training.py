"""Section `training`: the trainer SIGKILLed once right as its best checkpoint's weights are replaced, then at
random moments, `--resume`d each time, its checkpoints loaded after each kill, the final weights and losses
compared with an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import REPO, SHARED_DATA
from bench.reliability.harness import Problems

TRAIN_ARGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "48", "--block-size", "64", "--batch-size", "8",
              "--dropout", "0.1", "--learning-rate", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "10",
              "--eval-interval", "20", "--eval-iters", "4", "--checkpoint-interval", "10", "--log-interval", "5",
              "--device", "cpu", "--threads", "1", "--no-progress"]


def training_text(workdir: Path) -> Path:
    """40 KB of tiny Shakespeare where it lies beside the repository; else this repository's own prose."""
    shakespeare = SHARED_DATA / "tinyshakespeare" / "input.txt"
    raw = shakespeare.read_bytes() if shakespeare.is_file() else b"".join(
        p.read_bytes() for p in sorted(REPO.glob("*.md")) + sorted((REPO / "model").glob("*.py")))
    path = workdir / "input.txt"
    path.write_text(raw[:40_000].decode("utf-8", errors="ignore"), encoding="utf-8")
    return path


def _trainer(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "model.train", *argv], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def _resume_dir(out: Path) -> Path | None:
    """Where `--resume` reads from (the trainer's own rule: last/, else last.old/ after a torn swap)."""
    if (out / "last" / "resume.pt").is_file():
        return out / "last"
    if (out / "last.old" / "resume.pt").is_file():
        return out / "last.old"
    return None


def _loss_rows(out: Path) -> list[tuple]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("train_loss"), r.get("val_loss")) for r in rows]


def _await_training(out: Path, after_step: int, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Wait until the trainer logs a step past `after_step` (its start-up is over); False if it exited first."""
    deadline = time.perf_counter() + timeout
    while proc.poll() is None and time.perf_counter() < deadline:
        try:
            rows = (out / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            rows = []
        if any(json.loads(r)["step"] > after_step for r in rows[-3:] if r.endswith("}")):
            return True
        time.sleep(0.02)
    return False


def _await_weights_swap(out: Path, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Spin until `OUT/model.safetensors` is replaced by a new best checkpoint's weights; False if the trainer
    exited first. The trainer is then between the weights' rename and the config's, or just past it."""
    path = out / "model.safetensors"

    def inode() -> int | None:
        try:
            return path.stat().st_ino
        except FileNotFoundError:
            return None

    first = inode()
    deadline = time.perf_counter() + timeout
    while proc.poll() is None and time.perf_counter() < deadline:
        now = inode()
        if first is None:
            first = now  # the first best checkpoint: wait for the one that replaces it
        elif now != first:
            return True
    return False


def _reference(workdir: Path, base_argv: list[str], ref: Path, problems: Problems) -> tuple[float, float] | None:
    """The uninterrupted run into `ref`: (its seconds, its seconds after start-up), None if it failed."""
    t0 = time.perf_counter()
    proc = _trainer([*base_argv, "--out", str(ref)], workdir / "train-reference.log")
    started = _await_training(ref, 0, proc)
    startup = time.perf_counter() - t0
    rc = proc.wait(600)
    reference_s = time.perf_counter() - t0
    if rc != 0 or not started:
        problems.add(f"the reference run failed: {(workdir / 'train-reference.log').read_text()[-800:]}")
        return None
    return reference_s, reference_s - startup


class _KilledRun:
    """The run that is killed and resumed: where it is, what is planned for it, and what happened."""

    def __init__(self, workdir: Path, base_argv: list[str], plan: list[str], train_s: float, max_iters: int,
                 rng: random.Random, problems: Problems) -> None:
        self.workdir, self.out, self.base_argv = workdir, workdir / "train-killed", base_argv
        self.plan, self.train_s, self.max_iters, self.rng, self.problems = plan, train_s, max_iters, rng, problems
        self.events: list[dict[str, Any]] = []
        self.fresh_starts = 0
        self.launched = 0.0  # when the current attempt was started

    def launch(self) -> tuple[subprocess.Popen, int]:
        """Resume where `--resume` would, or start afresh (what an attempt killed early left goes): (process,
        the step it resumes from)."""
        from model.checkpoint import read_config

        resume_from = _resume_dir(self.out)
        if resume_from is None:
            self.fresh_starts += 1
            argv = [*self.base_argv, "--out", str(self.out), "--overwrite"]
        else:
            argv = ["--resume", "--out", str(self.out)]
        step = read_config(resume_from)["training"]["steps"] if resume_from else 0
        self.launched = time.perf_counter()
        return _trainer(argv, self.workdir / "train-killed.log"), step

    def kill(self, kind: str, proc: subprocess.Popen, step: int) -> dict[str, Any] | None:
        """SIGKILL at the moment `kind` names; the event, or None (a problem noted) if the run ended first."""
        event: dict[str, Any] = {"kind": kind, "resumed_from_step": step}
        if kind == "random":
            if not _await_training(self.out, step, proc):
                self.problems.add(f"the trainer exited ({proc.poll()}) before it logged a step (kill "
                                  f"{len(self.events) + 1})")
                return None
            # uniformly over the first 80% of the training left, shared among the kills still to come (a kill
            # drawn near the end would leave the next ones no training to interrupt)
            kills_left = self.plan[len(self.events):].count("random")
            delay = self.rng.uniform(0, 0.8 * self.train_s * (self.max_iters - step) / self.max_iters / kills_left)
            try:
                proc.wait(delay)
                self.problems.add(f"the run finished before kill {len(self.events) + 1} ({delay:.2f} s into "
                                  "training)")
                return None
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        else:
            if not _await_weights_swap(self.out, proc):
                self.problems.add("the run finished before the best checkpoint was replaced")
                return None
            proc.send_signal(signal.SIGKILL)
            event["config_rename_pending"] = (self.out / "config.next.json").is_file()
        return event

    def check_loads(self, kind: str, event: dict[str, Any]) -> None:
        """Every checkpoint on disk after a kill must load (last.tmp, half-written, may not); which step the next
        `--resume` starts from."""
        from model.checkpoint import CheckpointError, load_checkpoint, read_config

        loads: dict[str, Any] = {}
        for name in ("", "last", "last.old", "last.tmp"):
            d = self.out / name if name else self.out
            if not ((d / "config.json").is_file() or (d / "config.next.json").is_file()):
                continue
            try:
                loads[name or "OUT"] = load_checkpoint(d).training.get("steps")
            except CheckpointError as e:
                loads[name or "OUT"] = f"refused: {e}"
                if name != "last.tmp":  # last.tmp is the half-written next checkpoint; nothing reads it
                    self.problems.add(f"after kill {len(self.events) + 1} ({kind}), {d} does not load: {e}")
        nxt = _resume_dir(self.out)
        event.update(loaded_steps=loads, resumes_from=(nxt.name, read_config(nxt)["training"]["steps"]) if nxt
                     else "a fresh start (no checkpoint yet)")

    def run(self) -> None:
        """Every planned kill, each followed by a resume; the last resume runs to the end."""
        for kind in [*self.plan, None]:
            proc, step = self.launch()
            if kind is None:
                rc = proc.wait(600)
                if rc != 0:
                    self.problems.add(f"the final resume exited {rc}: "
                                      f"{(self.workdir / 'train-killed.log').read_text()[-800:]}")
                return
            event = self.kill(kind, proc, step)
            if event is None:
                return
            proc.wait()
            event["killed_after_s"] = round(time.perf_counter() - self.launched, 3)
            self.check_loads(kind, event)
            self.events.append(event)


def _compare(ref: Path, run: Path, max_iters: int, problems: Problems) -> dict[str, Any]:
    """The killed run's final and best checkpoints and its losses against the uninterrupted run's: bitwise."""
    import torch
    from safetensors.torch import load_file

    from model.checkpoint import read_config

    def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    a, b = load_file(ref / "last" / "model.safetensors"), load_file(run / "last" / "model.safetensors")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    same = equal(a, b)
    best_same = equal(load_file(ref / "model.safetensors"), load_file(run / "model.safetensors"))
    ref_t, run_t = read_config(ref / "last")["training"], read_config(run / "last")["training"]
    rows_same = _loss_rows(ref) == _loss_rows(run)
    if run_t["steps"] != max_iters:
        problems.add(f"the killed run ended at step {run_t['steps']}, not {max_iters}")
    if not same or run_t["val_loss"] != ref_t["val_loss"]:
        problems.add(f"the resumed run's final weights/loss differ from the reference (max |diff| {diff}, "
                     f"val loss {run_t['val_loss']} vs {ref_t['val_loss']})")
    if not best_same:
        problems.add("the best-validation checkpoint differs from the reference's")
    if not rows_same:
        problems.add("metrics.jsonl differs from the reference's")
    return {"final_step": run_t["steps"], "reference_val_loss": ref_t["val_loss"], "val_loss": run_t["val_loss"],
            "reference_train_loss": ref_t["train_loss"], "train_loss": run_t["train_loss"],
            "val_loss_abs_diff": abs(run_t["val_loss"] - ref_t["val_loss"]), "weights_max_abs_diff": diff,
            "final_weights_bitwise_equal": same, "best_checkpoint_bitwise_equal": best_same,
            "metrics_rows_equal": rows_same, "tolerance": "none: bitwise-equal weights, equal losses"}


def run(workdir: Path, kills: int, max_iters: int, seed: int, targeted: bool = True) -> dict[str, Any]:
    """An uninterrupted run, then the same run SIGKILLed and `--resume`d again and again: first (if `targeted`)
    the moment the best checkpoint's new weights are renamed into place, the one moment where weights and config
    on disk disagree, then `kills` times, each at a moment drawn uniformly over the first 80% of the training
    left divided by the kills still to come (start-up excluded: nothing is written then). After every kill the
    checkpoints on disk must load; at the end, weights and losses must equal the uninterrupted run's."""
    rng = random.Random(seed)
    problems = Problems()
    base_argv = ["--data", str(training_text(workdir)), *TRAIN_ARGS, "--max-iters", str(max_iters)]
    ref, out = workdir / "train-reference", workdir / "train-killed"
    for d in (ref, out):
        shutil.rmtree(d, ignore_errors=True)
    timed = _reference(workdir, base_argv, ref, problems)
    if timed is None:
        return problems.figures()
    reference_s, train_s = timed
    killed = _KilledRun(workdir, base_argv, ["weights renamed"] * targeted + ["random"] * kills, train_s,
                        max_iters, rng, problems)
    killed.run()
    result: dict[str, Any] = {"max_iters": max_iters, "kills": len(killed.events),
                              "fresh_starts": killed.fresh_starts, "reference_s": round(reference_s, 2),
                              "events": killed.events}
    if (out / "last").is_dir() and (out / "model.safetensors").is_file():
        result.update(_compare(ref, out, max_iters, problems))
    else:
        problems.add("the killed run has no checkpoint at the end")
    return problems.figures(**result)
