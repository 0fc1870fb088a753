"""Exact resume and crash safety: a resumed run equals the uninterrupted one bit for bit (with dropout too), the
best-validation checkpoint is kept, and a crash between or during checkpoint writes leaves a run that resumes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint, read_config
from model.train import resume as train_module  # writes last.tmp/
from model.train.__main__ import main
from model.train.config import resolve_config
from model.train.trainer import Trainer
from tests.train.runs import assert_same_weights, loss_rows, metrics, tiny_argv, train


@pytest.fixture(scope="module")
def reference(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 40-step tiny run, uninterrupted: what resumed and crashed runs must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train(tiny_argv(text_file, out))
    return out


# -- exact resume -------------------------------------------------------------------------------------


def test_resume_is_exact(reference: Path, text_file: Path, tmp_path: Path) -> None:
    """Stopping at step 20 and resuming to 40 gives the uninterrupted run's weights and metrics exactly."""
    out = tmp_path / "b"
    train(tiny_argv(text_file, out, "--stop-after", "20"))
    state = torch.load(out / "last" / "resume.pt", weights_only=True)
    assert state["step"] == 20
    assert read_config(out / "last")["training"]["steps"] == 20

    # --resume takes the saved run's config, then flags
    cfg, resume = resolve_config(["--resume", "--out", str(out), "--eval-iters", "3"])
    assert resume and cfg.n_embd == 32 and cfg.max_iters == 40 and cfg.eval_iters == 3

    train(["--resume", "--out", str(out)])
    assert_same_weights(reference / "last", out / "last")
    assert_same_weights(reference, out)  # the best-val checkpoint too
    assert loss_rows(out) == loss_rows(reference)
    ref, got = read_config(reference / "last")["training"], read_config(out / "last")["training"]
    assert (got["steps"], got["tokens_seen"]) == (ref["steps"], ref["tokens_seen"]) == (40, 40 * 8 * 32)


def test_resume_is_exact_with_dropout(text_file: Path, tmp_path: Path) -> None:
    """The torch RNG is saved and restored, so dropout masks after the resume are those of the full run."""
    full, split = tmp_path / "full", tmp_path / "split"
    train(tiny_argv(text_file, full, "--dropout", "0.1", max_iters=20))
    train(tiny_argv(text_file, split, "--dropout", "0.1", "--stop-after", "10", max_iters=20))
    train(["--resume", "--out", str(split)])
    assert_same_weights(full / "last", split / "last")
    assert loss_rows(full) == loss_rows(split)




# -- the best-validation checkpoint ----------------------------------------------------------------------


def test_best_checkpoint_has_the_lowest_val_loss(reference: Path) -> None:
    evals = [r for r in metrics(reference) if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30, 40]
    best = min(evals, key=lambda r: r["val_loss"])  # the first of equals, as the trainer keeps it
    training = read_config(reference)["training"]
    assert training["val_loss"] == best["val_loss"] and training["steps"] == best["step"]
    assert training["train_loss"] == best["train_loss"]


def test_best_checkpoint_is_kept_when_val_loss_rises(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted = iter([3.0, 2.0, 2.5, 2.2])  # evaluations at steps 10, 20, 30 and the final 40
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def estimate_loss(self: Trainer) -> dict[str, float]:
        snapshots[self.step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        val = next(scripted)
        return {"train": val - 0.25, "val": val}

    monkeypatch.setattr(Trainer, "estimate_loss", estimate_loss)
    out = tmp_path / "run"
    train(tiny_argv(text_file, out))
    training = read_config(out)["training"]
    assert (training["steps"], training["val_loss"], training["train_loss"]) == (20, 2.0, 1.75)
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(t, snapshots[20][k]) for k, t in saved.items())
    assert read_config(out / "last")["training"]["steps"] == 40


# -- a crash between checkpoint writes -------------------------------------------------------------------


class Crash(Exception):
    """Stands in for the process dying at that point."""


def test_crash_between_the_renames_of_the_swap(
    reference: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after `last` -> `last.old` and before `last.tmp` -> `last`: `last.old` is complete and resumes."""
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        dst = Path(dst)
        if Path(src).name == "last.tmp" and dst.name == "last" and (dst.parent / "last.old").exists():
            raise Crash
        real_replace(src, dst)

    out = tmp_path / "run"
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        main(tiny_argv(text_file, out))  # dies in the second swap, at step 20
    monkeypatch.undo()

    assert not (out / "last").exists()
    assert load_checkpoint(out / "last.old").training["steps"] == 10
    assert load_checkpoint(out / "last.tmp").training["steps"] == 20
    assert load_checkpoint(out).training["steps"] == 20  # the best checkpoint is untouched by the swap

    train(["--resume", "--out", str(out)])
    assert not (out / "last.old").exists() and not (out / "last.tmp").exists()
    assert_same_weights(reference / "last", out / "last")
    assert loss_rows(out) == loss_rows(reference)


def test_crash_while_writing_the_new_checkpoint(
    reference: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed half way through writing `last.tmp`: `last` is untouched and resumes."""
    real_save = train_module.save_checkpoint
    calls = []

    def save_checkpoint(directory: Path, *args: Any, **kwargs: Any) -> Path:
        if Path(directory).name == "last.tmp":
            calls.append(directory)
            if len(calls) == 2:  # the swap at step 20: leave a torn weights file behind
                Path(directory).mkdir(parents=True, exist_ok=True)
                (Path(directory) / "model.safetensors").write_bytes(b"\x00" * 100)
                raise Crash
        return real_save(directory, *args, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(train_module, "save_checkpoint", save_checkpoint)
    with pytest.raises(Crash):
        main(tiny_argv(text_file, out))
    monkeypatch.undo()

    assert load_checkpoint(out / "last").training["steps"] == 10
    train(["--resume", "--out", str(out)])
    assert not (out / "last.tmp").exists()
    assert_same_weights(reference / "last", out / "last")
    assert loss_rows(out) == loss_rows(reference)
