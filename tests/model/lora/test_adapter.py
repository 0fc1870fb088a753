"""LoRA adapters in PEFT's format (model/lora.py) and `folio merge` (model/merge.py): PEFT itself loads a Folio
adapter onto Hugging Face's GPT2LMHeadModel with the same logits, Folio reads PEFT's own adapters with PEFT's logits,
a merged checkpoint computes what base plus adapter computes, and adapters that do not fit are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.convert import load_hf_gpt2
from model.lora.adapter import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterError,
    LoRAConfig,
    add_lora,
    apply_adapter,
    merge_adapter,
    read_adapter,
    save_adapter,
    trainable_parameters,
)
from model.lora.batched import load_adapter
from model.merge import main as merge_main
from model.testing import random_gpt
from model.tokenizer import CharTokenizer

peft = pytest.importorskip("peft")
ALL = ("c_attn", "c_proj", "c_fc")


def _randomize_b(adapted: dict) -> None:
    """A fresh adapter is the identity (B = 0): give B values so that a mistake shows in the logits."""
    with torch.no_grad():
        for m in adapted.values():
            m.lora_B.weight.normal_(0, 0.05)


@pytest.fixture
def hf_base(hf_gpt2):
    src, hf = hf_gpt2(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=1000)
    return src, hf


def test_peft_loads_a_folio_adapter_onto_gpt2_with_the_same_logits(hf_base, tmp_path: Path) -> None:
    src, hf = hf_base
    model = load_hf_gpt2(src)
    config = LoRAConfig(r=4, lora_alpha=8.0, target_modules=ALL)
    torch.manual_seed(0)
    _randomize_b(add_lora(model, config))
    save_adapter(tmp_path, model, config)

    written = json.loads((tmp_path / ADAPTER_CONFIG_FILE).read_text())
    assert (written["peft_type"], written["r"], written["lora_alpha"], written["fan_in_fan_out"]) == ("LORA", 4, 8.0,
                                                                                                      True)
    tensors = load_file(tmp_path / ADAPTER_WEIGHTS_FILE)
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.transformer.h.1.mlp.c_proj.lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 2 * 2 * 4  # layers x (A, B) x (c_attn, attn.c_proj, c_fc, mlp.c_proj)

    idx = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = hf(idx).logits.clone()
        ours = model.eval()(idx)
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path).eval()(idx).logits
    assert (ours - base_logits).abs().max() > 1e-2  # the adapter changes the model
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def test_an_adapter_made_by_peft_reads_applies_and_merges_as_peft_does(hf_base, tmp_path: Path) -> None:
    src, hf = hf_base
    torch.manual_seed(2)
    peft_config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["c_attn", "mlp.c_proj"], fan_in_fan_out=True)
    made = peft.get_peft_model(hf, peft_config)
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    made.save_pretrained(tmp_path)
    idx = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = made.eval()(idx).logits
        merged_by_peft = made.merge_and_unload()(idx).logits

    adapter = read_adapter(tmp_path)
    assert adapter.config.scaling == 32 / 8
    assert sorted(adapter.weights) == [f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("attn.c_attn", "mlp.c_proj")]
    applied = load_hf_gpt2(src)
    apply_adapter(applied, adapter)
    merged = merge_adapter(load_hf_gpt2(src), adapter)
    with torch.no_grad():
        assert torch.allclose(applied.eval()(idx), want, atol=1e-5, rtol=0)
        assert torch.allclose(merged(idx), merged_by_peft, atol=1e-5, rtol=0)


def test_folio_merge_writes_a_checkpoint_equal_to_base_plus_adapter(tmp_path: Path) -> None:
    config = GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, bias=False)
    tokenizer = CharTokenizer([chr(c) for c in range(32, 97)])
    base = save_checkpoint(tmp_path / "base", random_gpt(config, seed=5), tokenizer)
    model = load_checkpoint(base).model
    lora = LoRAConfig(r=2, lora_alpha=3.0, target_modules=("attn.c_proj", "c_fc"))
    torch.manual_seed(6)
    _randomize_b(add_lora(model, lora))
    save_adapter(tmp_path / "adapter", model, lora)

    assert merge_main([str(base), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    merged = load_checkpoint(tmp_path / "merged")
    assert merged.tokenizer.chars == tokenizer.chars
    assert merged.training["merged_from"]["r"] == 2
    idx = torch.randint(0, 65, (3, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got, plain = model.eval()(idx), merged.model(idx), load_checkpoint(base).model(idx)
    assert (want - plain).abs().max() > 1e-2
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_an_adapter_that_does_not_fit_its_base_is_refused_naming_the_module(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=16)
    lora = LoRAConfig(r=2, target_modules=("c_attn",))
    model = random_gpt(small, seed=0)
    add_lora(model, lora)
    save_adapter(tmp_path / "adapter", model, lora)
    wide = GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=32)
    base = save_checkpoint(tmp_path / "base", random_gpt(wide, seed=0), CharTokenizer([chr(c) for c in range(32, 97)]))
    assert merge_main([str(base), str(tmp_path / "adapter"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "transformer.h.0.attn.c_attn has lora_A (2, 16)" in err and "(2, 32)" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "needle"), [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"r": 4}, "has rank 2"),
    ({"target_modules": ".*c_attn"}, "is a regular expression"),
    ({"peft_type": "IA3"}, "only LoRA adapters"),
    ({"target_modules": 5}, "target_modules must be a list of names"),
    ({"target_modules": [["c_attn"]]}, "target_modules must be a list of names"),
    ({"lora_dropout": [1]}, "lora_dropout must be a number, got \\[1\\]"),
    ({"lora_dropout": "0.1"}, "lora_dropout must be a number"),
])
def test_peft_settings_folio_does_not_implement_are_refused(tmp_path: Path, change: dict, needle: str) -> None:
    model = random_gpt(GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=16), seed=0)
    lora = LoRAConfig(r=2)
    add_lora(model, lora)
    save_adapter(tmp_path, model, lora)
    path = tmp_path / ADAPTER_CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(AdapterError, match=needle):
        read_adapter(tmp_path)


def test_an_adapter_config_nested_too_deeply_or_unreadable_is_refused(tmp_path: Path) -> None:
    """What json or the file system raise besides a decoding error is an AdapterError too (a 400 over HTTP)."""
    (tmp_path / ADAPTER_WEIGHTS_FILE).write_bytes(b"")
    (tmp_path / ADAPTER_CONFIG_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterError, match="nests too deeply"):
        read_adapter(tmp_path)
    (tmp_path / ADAPTER_CONFIG_FILE).unlink()
    (tmp_path / ADAPTER_CONFIG_FILE).mkdir()  # is_file() says no: the "missing" message
    with pytest.raises(AdapterError, match="is missing"):
        read_adapter(tmp_path)
    with pytest.raises(AdapterError, match="adapter directory cannot be read: .*File name too long"):
        load_adapter(tmp_path / ("a" * 300), GPTConfig())


def test_factors_holding_nan_or_infinity_are_refused(tmp_path: Path) -> None:
    """Every request through such an adapter would fail at its first token: it is not loaded."""
    model = random_gpt(GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=16), seed=0)
    lora = LoRAConfig(r=2)
    add_lora(model, lora)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.lora_B.weight[0, 0] = float("nan")
    save_adapter(tmp_path, model, lora)
    with pytest.raises(AdapterError, match="lora_B.weight holds NaN or infinite values"):
        read_adapter(tmp_path)


def test_a_tensor_that_is_no_gpt2_linear_is_refused(tmp_path: Path) -> None:
    (tmp_path / ADAPTER_CONFIG_FILE).write_text(json.dumps(LoRAConfig(r=2).to_peft()))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 16),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(65, 2)}, tmp_path / ADAPTER_WEIGHTS_FILE)
    with pytest.raises(AdapterError, match="'base_model.model.lm_head.lora_A.weight' is not a LoRA factor"):
        read_adapter(tmp_path)


def test_trainable_parameters_for_gpt2_124m() -> None:
    """r * (in + out) per adapted linear: GPT-2 small, rank 8 on c_attn (PEFT's default): 12 * 8 * (768 + 2304)."""
    gpt2 = GPTConfig()
    assert trainable_parameters(gpt2, LoRAConfig(r=8)) == 12 * 8 * (768 + 2304) == 294_912
    assert trainable_parameters(gpt2, LoRAConfig(r=16, target_modules=ALL)) == 12 * 16 * (
        (768 + 2304) + (768 + 768) + (768 + 3072) + (3072 + 768)) == 2_359_296
