"""`python -m model.train` end to end and its command line: a loadable, self-describing checkpoint that
`python -m model.generate` reads, the loss plot (redrawn at every evaluation and when a signal stops the run), and
every input error as exit code 2 with one clear line before anything is trained, a run already in --out never
overwritten unasked."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from model.checkpoint import Checkpoint, load_checkpoint, read_config
from model.config import GPTConfig
from model.train.__main__ import main
from model.train.config import resolve_config
from model.train.outputs import plot_metrics
from model.train.resume import load_state
from model.train.trainer import Trainer
from tests import REPO
from tests.train.runs import ENV, PNG_MAGIC, metrics, tiny_argv, train, write_file


def assert_run_files(out: Path) -> None:
    """A finished run's files: the best checkpoint, metrics, a drawn loss plot, `last/` with its resume state, and
    no half-swapped `last.tmp` or `last.old` left."""
    for name in ("model.safetensors", "config.json", "metrics.jsonl", "loss.png",
                 "last/model.safetensors", "last/config.json", "last/resume.pt"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "loss.png").stat().st_size > 5_000  # a drawn figure, not an empty image
    assert not (out / "last.tmp").exists() and not (out / "last.old").exists()


def greedy_by_hand(ck: Checkpoint, prompt: str, n: int) -> str:
    """The greedy continuation of a character-level prompt, by hand: argmax of a full forward, `n` times."""
    ids = ck.tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = ck.model(torch.tensor([ids[-ck.config.block_size:]]))
            ids.append(int(logits[0, -1].argmax()))
    return ck.tokenizer.decode(ids[len(prompt):])


def test_cli_end_to_end(text_file: Path, tmp_path: Path) -> None:
    """`python -m model.train` writes a loadable, self-describing checkpoint `python -m model.generate` reads."""
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "model.train", "--preset", "shakespeare-char-cpu",
           *tiny_argv(text_file, out, "--lr-decay-iters", "30", max_iters=30)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    assert_run_files(out)
    training = read_config(out)["training"]
    text = text_file.read_text(encoding="utf-8")
    assert training["steps"] == 30  # the final evaluation is the best one here
    assert training["tokens_seen"] == 30 * 8 * 32
    assert training["dataset"] == text_file.name
    assert training["dataset_sha256"] == hashlib.sha256(text_file.read_bytes()).hexdigest()
    assert isinstance(training["wall_time_s"], float) and training["wall_time_s"] >= 0
    assert training["device"] == "cpu"
    assert training["torch_version"] == torch.__version__
    assert training["preset"] == "shakespeare-char-cpu"
    # flags win over the preset; what the preset set and no flag touched survives
    assert training["train_config"]["n_embd"] == 32 and training["train_config"]["beta2"] == 0.99

    ck = load_checkpoint(out)
    vocab = len(set(text))
    assert ck.tokenizer.n_vocab == vocab
    assert ck.config == GPTConfig(block_size=32, vocab_size=vocab, n_layer=1, n_head=2, n_embd=32, dropout=0.0,
                                  bias=False)
    # an untrained model predicts uniformly: loss ln(vocab); 30 steps must be well below it
    initial = math.log(vocab)
    assert training["train_loss"] < initial - 0.5
    assert training["val_loss"] < initial - 0.5
    batch_losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert batch_losses[-1] < batch_losses[0] < initial + 0.1

    prompt = "ROMEO:"
    cmd = [sys.executable, "-m", "model.generate", "--checkpoint", str(out), "--prompt", prompt, "--greedy",
           "--max-new-tokens", "20"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(prompt) and proc.stdout.endswith("\n")
    generated = proc.stdout[len(prompt):-1]
    assert len(generated) == 20
    assert generated == greedy_by_hand(ck, prompt, 20)


def test_cli_error_is_exit_code_2_without_traceback(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "model.train", "--data", str(tmp_path / "missing.txt"), "--out",
           str(tmp_path / "out"), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: data file not found" in proc.stderr and "missing.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loss_png_is_redrawn_at_every_evaluation(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-run, after each evaluation, `loss.png` is a complete PNG with that evaluation on it: seen from inside
    the run, at every training step, by wrapping `Trainer.train_step`."""
    from PIL import Image

    out, seen = tmp_path / "run", {}
    real_step = Trainer.train_step

    def train_step(self: Trainer, lr: float) -> float:
        png = out / "loss.png"
        if png.exists():
            with Image.open(png) as image:
                image.verify()  # a whole, valid PNG (never a half-written one)
            seen[self.step] = hashlib.sha256(png.read_bytes()).hexdigest()
        return real_step(self, lr)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    train(tiny_argv(text_file, out, max_iters=25))  # evaluations at steps 10, 20 and 25 (the final one)
    assert sorted(seen) == list(range(10, 25))  # from the first evaluation on, not only at the end
    assert len({seen[s] for s in range(10, 20)}) == 1 and seen[20] != seen[10]  # redrawn at step 20's evaluation
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert hashlib.sha256((out / "loss.png").read_bytes()).hexdigest() != seen[20]  # and at the final one




def completed_rows(metrics_file: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl that a running process may be appending to: whole lines only."""
    text = metrics_file.read_text() if metrics_file.is_file() else ""
    return [json.loads(ln) for ln in text[: text.rfind("\n") + 1].splitlines() if ln]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_stops_a_run_after_its_step_and_redraws_the_loss_curve(
        text_file: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM (or Ctrl-C) during a run, after its first evaluation: it stops after the step in progress, with the
    shell's exit code for the signal (143, 130); that step is the last row of metrics.jsonl (logged though not on
    a log interval), loss.png is the curve of every row (byte for byte a fresh drawing of metrics.jsonl, not the
    one of the last evaluation) and last/ holds that step, so --resume continues."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "model.train", *tiny_argv(text_file, out, max_iters=1_000_000)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # the first evaluation is at step 10: a second on an idle machine
        while not any("val_loss" in row for row in completed_rows(out / "metrics.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    rows = metrics(out)
    summary = json.loads(stdout.splitlines()[-1])
    assert summary["stopped_by"] == sig.name and summary["step"] == rows[-1]["step"] > 10 and "loss" in rows[-1]
    assert f"stopped by {sig.name} at step {summary['step']}" in stderr and "Traceback" not in stderr
    redrawn = tmp_path / "redrawn" / "run" / "loss.png"  # the title is the run directory's name
    redrawn.parent.mkdir(parents=True)
    plot_metrics(out / "metrics.jsonl", redrawn)
    assert (out / "loss.png").read_bytes() == redrawn.read_bytes()
    assert load_state(out / "last", torch.device("cpu"))["step"] == summary["step"]


# -- bad input: exit code 2, a message naming the problem, nothing trained -----------------------------


BAD_INPUT = {
    "missing data file": (
        lambda d, text: ["--data", str(d / "nope.txt")], "data file not found"),
    "empty data file": (
        lambda d, text: ["--data", str(write_file(d / "empty.txt", " \n\n"))], "data file is empty"),
    "data not UTF-8": (
        lambda d, text: ["--data", str(write_file(d / "latin1.txt", "café ".encode("latin-1") * 200))], "not UTF-8"),
    "text shorter than one block": (
        lambda d, text: ["--data", str(write_file(d / "short.txt", "To be, or not to be.\n" * 3))],
        "fewer than one block"),
    "n_embd not divisible by n_head": (
        lambda d, text: ["--n-embd", "30", "--n-head", "4"], "--n-embd (30) must be divisible by --n-head (4)"),
    "max_iters zero": (lambda d, text: ["--max-iters", "0"], "--max-iters must be at least 1"),
    "dropout one": (lambda d, text: ["--dropout", "1"], "--dropout must be in [0, 1)"),
    "output under a regular file": (
        lambda d, text: ["--out", str(write_file(d / "a-file", "x") / "out")], "is not writable"),
    "unknown preset in config file": (
        lambda d, text: ["--config", str(write_file(d / "c.json", '{"preset": "gpt5"}'))], "unknown preset 'gpt5'"),
    "config file missing": (lambda d, text: ["--config", str(d / "none.toml")], "--config file not found"),
    "config file bad JSON": (
        lambda d, text: ["--config", str(write_file(d / "c.json", '{"n_layer": 2,}'))], "c.json"),
    "config file bad TOML": (
        lambda d, text: ["--config", str(write_file(d / "c.toml", "n_layer = = 2\n"))], "c.toml"),
    "config file not an object": (
        lambda d, text: ["--config", str(write_file(d / "c.json", "[1, 2]"))], "expected an object"),
    "config file unknown field": (
        lambda d, text: ["--config", str(write_file(d / "c.json", '{"n_layers": 2}'))], "unknown fields ['n_layers']"),
    "config file wrong type": (
        lambda d, text: ["--config", str(write_file(d / "c.toml", 'n_layer = "two"\n'))],
        "n_layer must be of type int"),
    "config file bool for int": (
        lambda d, text: ["--config", str(write_file(d / "c.json", '{"max_iters": true}'))],
        "max_iters must be of type int"),
    "resume without last/": (
        lambda d, text: ["--resume", "--out", str(d / "empty-run")], "cannot resume"),
    "not a device": (lambda d, text: ["--device", "gpu0"], "--device gpu0: not a device name; use auto, cpu, cuda"),
    "more threads than cores": (lambda d, text: ["--threads", str((os.cpu_count() or 1) + 1)],
                                "--threads must be between 0 (all cores)"),
    "NaN learning rate": (lambda d, text: ["--learning-rate", "nan"], "--learning-rate must be a finite number"),
    # refused from the config's arithmetic, before a layer is built or a batch drawn (either would take hours)
    "a model larger than memory": (
        lambda d, text: ["--n-layer", "1000000000"], "n_layer 1000000000, n_embd 32"),
    "a batch larger than memory": (
        lambda d, text: ["--batch-size", "10000000000"], "the logits of a 10000000000x32 batch, in float32) needs"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_before_training(
    case: str, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_argv, message = BAD_INPUT[case]
    (tmp_path / "empty-run").mkdir()
    out = tmp_path / "out"
    argv = tiny_argv(text_file, out) + make_argv(tmp_path, text_file)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    for d in (out, tmp_path / "empty-run"):
        assert not (d / "metrics.jsonl").exists() and not (d / "model.safetensors").exists()
        assert not (d / "last").exists()


def test_resume_needs_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_unknown_preset_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--preset", "gpt5", "--data", "x", "--out", "y"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--preset" in err and "gpt5" in err and "shakespeare-char" in err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, not a usage dump


def test_gpt2_tokenizer_offline_without_bpe_dir_is_one_error_line(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import requests

    from model import tokenizer

    def offline(**kwargs: Any) -> None:  # what tiktoken's download does on a machine without network
        raise requests.exceptions.ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.delenv("FOLIO_GPT2_BPE_DIR", raising=False)
    monkeypatch.setattr(tokenizer, "data_gym_to_mergeable_bpe_ranks", offline)
    assert main(tiny_argv(text_file, tmp_path / "out", "--tokenizer", "gpt2")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot download GPT-2's BPE files") and err.count("\n") == 1, err
    assert "(ConnectionError)" in err and "--bpe-dir" in err and "FOLIO_GPT2_BPE_DIR" in err


# -- a run already in --out --------------------------------------------------------------------------------


def test_a_run_in_out_is_never_overwritten_unasked(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    train(tiny_argv(text_file, out, max_iters=10))
    before = {name: (out / name).read_bytes() for name in ("model.safetensors", "config.json", "metrics.jsonl")}
    capsys.readouterr()

    assert main(tiny_argv(text_file, out, "--seed", "7", max_iters=10)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} already holds a run (config.json, model.safetensors, metrics.jsonl, "
                          "loss.png, last): continue it with --resume, or delete it and start afresh with "
                          "--overwrite"), err
    assert {name: (out / name).read_bytes() for name in before} == before  # untouched

    assert main(["--resume", "--overwrite", "--out", str(out)]) == 2
    assert "--resume continues the run in --out and --overwrite deletes it: pass one of them" in capsys.readouterr().err

    # --overwrite: the old run goes as a whole, so its metrics do not mix with the new run's
    train(tiny_argv(text_file, out, "--seed", "7", "--overwrite", max_iters=10))
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    steps = [r["step"] for r in metrics(out) if "loss" in r]
    assert steps == [5, 10]  # one run's rows, not two runs' appended
    assert read_config(out)["training"]["train_config"]["seed"] == 7
    # and a resume of that run does not delete it again
    cfg, resume = resolve_config(["--resume", "--out", str(out)])
    assert resume and not cfg.overwrite


def test_a_directory_with_only_unrelated_files_is_not_a_run(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    train(tiny_argv(text_file, out, max_iters=5))
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
