"""The training configuration: preset < --config file < flags, a flag for every field, the learning-rate
schedule, and weight decay on matrices only."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.train.config import PRESETS, TrainConfig, resolve_config
from model.train.optim import configure_optimizer, get_lr
from tests.train.runs import write_file

# -- configuration: preset < --config < flags ----------------------------------------------------------


@pytest.mark.parametrize(
    "name, content",
    [
        ("c.json", '{"n_layer": 2, "n-embd": 64, "learning_rate": 5e-4, "min_lr": 0}'),
        ("c.toml", "n_layer = 2\nn-embd = 64\nlearning_rate = 5e-4\nmin_lr = 0\n"),
    ],
)
def test_preset_then_config_file_then_flags(name: str, content: str, tmp_path: Path) -> None:
    path = write_file(tmp_path / name, content)
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
    path = write_file(tmp_path / "c.toml", 'preset = "shakespeare-char-small"\nn_layer = 2\n')
    cfg, _ = resolve_config(["--config", str(path)])
    assert cfg.preset == "shakespeare-char-small"
    assert cfg.n_layer == 2 and cfg.n_embd == PRESETS["shakespeare-char-small"]["n_embd"]


def test_every_field_has_a_kebab_case_flag() -> None:
    argv, want = [], {}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "init_from":  # takes the shape from its model: with a shape flag it is an error (test_finetune)
            want[f.name] = f.default
        elif f.type == "bool":
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
