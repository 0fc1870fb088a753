"""The offline train module: the CLI end to end, exact resume, input errors, configuration precedence, the
learning-rate schedule, weight-decay groups, the best-validation checkpoint and crash safety of `OUT/last/`.

Every run is tiny (one layer, 32 wide, a 20 KB text, tens of steps) and in-process through `main(argv)`
where the CLI itself is not under test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from model import train as train_module
from model.checkpoint import load_checkpoint, read_config
from model.config import GPTConfig
from model.gpt import GPT
from model.train import PRESETS, TrainConfig, Trainer, configure_optimizer, get_lr, main, resolve_config
from tests import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# one layer, 32 wide, 32 tokens of context; eval and checkpoint every 10 steps; no dropout
TINY = [
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
    "--dropout", "0", "--learning-rate", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "5",
    "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "5", "--device", "cpu", "--no-progress",
]


def tiny_argv(text: Path, out: Path, *extra: str, max_iters: int = 40) -> list[str]:
    return ["--data", str(text), "--out", str(out), *TINY, "--max-iters", str(max_iters), *extra]


def train(argv: list[str]) -> None:
    assert main(argv) == 0


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]


def loss_rows(out: Path) -> list[tuple]:
    """Everything in metrics.jsonl that a rerun must reproduce (throughput is left out)."""
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("train_loss"), r.get("val_loss")) for r in metrics(out)]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"tensors differ between {a} and {b}: {different}"


@pytest.fixture(scope="module")
def reference(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 40-step tiny run, uninterrupted: what resumed and crashed runs must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train(tiny_argv(text_file, out))
    return out


# -- end to end ---------------------------------------------------------------------------------------


def test_cli_end_to_end(text_file: Path, tmp_path: Path) -> None:
    """`python -m model.train` writes a loadable, self-describing checkpoint `python -m model.sample` reads."""
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "model.train", "--preset", "shakespeare-char-cpu",
           *tiny_argv(text_file, out, "--lr-decay-iters", "30", max_iters=30)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    for name in ("model.safetensors", "config.json", "metrics.jsonl", "loss.png",
                 "last/model.safetensors", "last/config.json", "last/resume.pt"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "loss.png").stat().st_size > 5_000  # a drawn figure, not an empty image
    assert not (out / "last.tmp").exists() and not (out / "last.old").exists()

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
    cmd = [sys.executable, "-m", "model.sample", "--checkpoint", str(out), "--prompt", prompt, "--greedy",
           "--max-new-tokens", "20"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(prompt) and proc.stdout.endswith("\n")
    generated = proc.stdout[len(prompt):-1]
    assert len(generated) == 20
    # the greedy continuation, by hand
    ids = ck.tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(20):
            logits = ck.model(torch.tensor([ids[-ck.config.block_size:]]))
            ids.append(int(logits[0, -1].argmax()))
    assert generated == ck.tokenizer.decode(ids[len(prompt):])


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


# -- bad input: exit code 2, a message naming the problem, nothing trained -----------------------------


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


BAD_INPUT = {
    "missing data file": (
        lambda d, text: ["--data", str(d / "nope.txt")], "data file not found"),
    "empty data file": (
        lambda d, text: ["--data", str(_write(d / "empty.txt", " \n\n"))], "data file is empty"),
    "data not UTF-8": (
        lambda d, text: ["--data", str(_write(d / "latin1.txt", "café ".encode("latin-1") * 200))], "not UTF-8"),
    "text shorter than one block": (
        lambda d, text: ["--data", str(_write(d / "short.txt", "To be, or not to be.\n" * 3))],
        "fewer than one block"),
    "n_embd not divisible by n_head": (
        lambda d, text: ["--n-embd", "30", "--n-head", "4"], "--n-embd (30) must be divisible by --n-head (4)"),
    "max_iters zero": (lambda d, text: ["--max-iters", "0"], "--max-iters must be at least 1"),
    "dropout one": (lambda d, text: ["--dropout", "1"], "--dropout must be in [0, 1)"),
    "output under a regular file": (
        lambda d, text: ["--out", str(_write(d / "a-file", "x") / "out")], "is not writable"),
    "unknown preset in config file": (
        lambda d, text: ["--config", str(_write(d / "c.json", '{"preset": "gpt5"}'))], "unknown preset 'gpt5'"),
    "config file missing": (lambda d, text: ["--config", str(d / "none.toml")], "--config file not found"),
    "config file bad JSON": (
        lambda d, text: ["--config", str(_write(d / "c.json", '{"n_layer": 2,}'))], "c.json"),
    "config file bad TOML": (
        lambda d, text: ["--config", str(_write(d / "c.toml", "n_layer = = 2\n"))], "c.toml"),
    "config file not an object": (
        lambda d, text: ["--config", str(_write(d / "c.json", "[1, 2]"))], "expected an object"),
    "config file unknown field": (
        lambda d, text: ["--config", str(_write(d / "c.json", '{"n_layers": 2}'))], "unknown fields ['n_layers']"),
    "config file wrong type": (
        lambda d, text: ["--config", str(_write(d / "c.toml", 'n_layer = "two"\n'))],
        "n_layer must be of type int"),
    "config file bool for int": (
        lambda d, text: ["--config", str(_write(d / "c.json", '{"max_iters": true}'))],
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


# -- configuration: preset < --config < flags ----------------------------------------------------------


@pytest.mark.parametrize(
    "name, content",
    [
        ("c.json", '{"n_layer": 2, "n-embd": 64, "learning_rate": 5e-4, "min_lr": 0}'),
        ("c.toml", "n_layer = 2\nn-embd = 64\nlearning_rate = 5e-4\nmin_lr = 0\n"),
    ],
)
def test_preset_then_config_file_then_flags(name: str, content: str, tmp_path: Path) -> None:
    path = _write(tmp_path / name, content)
    cfg, resume = resolve_config(["--preset", "shakespeare-char-cpu", "--config", str(path), "--n-layer", "3"])
    preset = PRESETS["shakespeare-char-cpu"]
    assert not resume
    assert cfg.preset == "shakespeare-char-cpu"
    assert cfg.n_layer == 3  # flag over config file over preset
    assert cfg.n_embd == 64 and cfg.learning_rate == 5e-4  # config file over preset (kebab keys too)
    assert cfg.min_lr == 0.0 and isinstance(cfg.min_lr, float)  # an integer is a fine float
    assert (cfg.block_size, cfg.batch_size, cfg.eval_iters) == (
        preset["block_size"], preset["batch_size"], preset["eval_iters"])  # preset over defaults
    assert cfg.seed == TrainConfig.seed and cfg.grad_clip == TrainConfig.grad_clip  # defaults


def test_config_file_can_name_the_preset(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.toml", 'preset = "shakespeare-char-small"\nn_layer = 2\n')
    cfg, _ = resolve_config(["--config", str(path)])
    assert cfg.preset == "shakespeare-char-small"
    assert cfg.n_layer == 2 and cfg.n_embd == PRESETS["shakespeare-char-small"]["n_embd"]


def test_every_field_has_a_kebab_case_flag() -> None:
    argv, want = [], {}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            argv.append(flag if not f.default else "--no-" + f.name.replace("_", "-"))
            want[f.name] = not f.default
        elif f.name == "preset":
            argv += [flag, "gpt2-124m"]
            want[f.name] = "gpt2-124m"
        elif f.type == "str":
            argv += [flag, f"value-of-{f.name}"]
            want[f.name] = f"value-of-{f.name}"
        else:
            value = f.default + 3 if f.type == "int" else f.default + 0.5
            argv += [flag, str(value)]
            want[f.name] = value
    cfg, _ = resolve_config(argv)
    assert dataclasses.asdict(cfg) == want


def test_boolean_flags_have_no_forms() -> None:
    assert resolve_config(["--bias"])[0].bias is True
    assert resolve_config(["--preset", "gpt2-124m"])[0].bias is True
    assert resolve_config(["--preset", "gpt2-124m", "--no-bias"])[0].bias is False
    cfg, _ = resolve_config(["--no-progress", "--no-decay-lr", "--compile"])
    assert (cfg.progress, cfg.decay_lr, cfg.compile) == (False, False, True)


# -- learning-rate schedule ----------------------------------------------------------------------------


def test_get_lr_warmup_cosine_then_floor() -> None:
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    warmup = [get_lr(it, cfg) for it in range(10)]
    assert warmup[0] == pytest.approx(1 / 11) and warmup[-1] == pytest.approx(10 / 11)
    steps = [b - a for a, b in zip(warmup, warmup[1:])]
    assert steps == pytest.approx([1 / 11] * 9)  # linear
    assert get_lr(10, cfg) == pytest.approx(1.0)  # peak at the end of warmup
    assert get_lr(35, cfg) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi / 4)) * 0.9)
    assert get_lr(60, cfg) == pytest.approx(0.55)  # half way: the mean of peak and floor
    decay = [get_lr(it, cfg) for it in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert get_lr(110, cfg) == pytest.approx(0.1)
    assert get_lr(111, cfg) == get_lr(10_000, cfg) == 0.1


def test_get_lr_defaults_and_constant() -> None:
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=0, lr_decay_iters=0, max_iters=50)
    assert get_lr(0, cfg) == pytest.approx(1.0)
    assert get_lr(50, cfg) == pytest.approx(0.1)  # lr_decay_iters 0 means max_iters
    constant = dataclasses.replace(cfg, decay_lr=False, warmup_iters=10)
    assert {get_lr(it, constant) for it in (0, 5, 50, 500)} == {1.0}


# -- optimizer: weight decay on matrices only ------------------------------------------------------------


def test_weight_decay_only_on_matrices() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8, bias=True))
    opt = configure_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    name = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight"} <= {
        name[id(p)] for p in decay["params"]}
    assert {"transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.bias", "transformer.ln_f.weight"} <= {
        name[id(p)] for p in no_decay["params"]}
    # every parameter exactly once (the tied LM head is `wte`)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}

    # with zero gradients AdamW's update is zero, so what moves is decay alone: p *= 1 - lr * wd
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for g in opt.param_groups:
        g["lr"] = 0.5
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        expected = before[n] * (1 - 0.5 * 0.1) if p.dim() >= 2 else before[n]
        torch.testing.assert_close(p.detach(), expected, msg=f"{n} decayed wrongly")


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
