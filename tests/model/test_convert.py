"""Converters: Hugging Face GPT-2 and nanoGPT checkpoints into Folio, with parity and safe refusals."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.chat_template import ChatTemplate, special_tokens
from model.checkpoint import load_checkpoint
from model.config import GPTConfig
from model.convert import (
    ConvertError,
    convert_hf,
    convert_nanogpt,
    hf_chat_template,
    load_hf_gpt2,
    main,
    read_meta_pkl,
)
from model.gpt import GPT
from model.tokenizer import BPETokenizer, CharTokenizer


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _RunsCommand:
    """Unpickling this calls os.system(command): what a malicious pickle does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture
def bpe(gpt2_tok: BPETokenizer, bpe_dir: Path) -> Path:
    """The GPT-2 BPE folder, for tests that build the tokenizer (skipped where the files are absent)."""
    return bpe_dir


# --- Hugging Face --------------------------------------------------------------------------------------------


@pytest.fixture
def hf_small(hf_gpt2):
    """A GPT-2 with GPT-2's real vocabulary (so the BPE tokenizer fits) but a tiny body."""
    return hf_gpt2(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)


def test_hf_conversion_matches_transformers(hf_small, gpt2_tok: BPETokenizer, bpe: Path, tmp_path: Path) -> None:
    src, hf = hf_small
    out = convert_hf(src, tmp_path / "out", bpe_dir=bpe)
    ckpt = load_checkpoint(out)
    assert ckpt.config == GPTConfig(block_size=32, vocab_size=50257, n_layer=2, n_head=2, n_embd=32, bias=True)
    assert isinstance(ckpt.tokenizer, BPETokenizer) and ckpt.tokenizer.n_vocab == 50257
    assert ckpt.training["converted_from"] == "huggingface-gpt2"
    assert ckpt.training["source_sha256"] == _sha256(src / "model.safetensors")
    idx = torch.tensor([gpt2_tok.encode("Hello world, this is a tiny random GPT-2 that should agree.")[:32]])
    with torch.no_grad():
        diff = (ckpt.model(idx) - hf(idx).logits).abs().max().item()
    assert diff <= 1e-4


def test_hf_cli_converts_and_exits_zero(
    hf_small, bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, _ = hf_small
    out = tmp_path / "cli-out"
    assert main(["hf", str(src), str(out), "--bpe-dir", str(bpe)]) == 0
    assert "wrote Folio checkpoint" in capsys.readouterr().out
    assert load_checkpoint(out).config.vocab_size == 50257


def _hf_copy(hf_gpt2, tmp_path: Path) -> Path:
    src, _ = hf_gpt2(n_layer=1, n_head=2, n_embd=16, n_positions=8, vocab_size=100)
    return Path(shutil.copytree(src, tmp_path / "hf"))


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("activation_function", "relu", "activation_function='relu' is not supported"),
        ("layer_norm_epsilon", 1e-6, "layer_norm_epsilon=1e-06 is not supported"),
        ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=True is not supported"),
        ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn=True is not supported"),
        ("add_cross_attention", True, "add_cross_attention=True is not supported"),
        ("scale_attn_weights", False, "scale_attn_weights=False is not supported"),
        ("tie_word_embeddings", False, "tie_word_embeddings=False is not supported"),
        ("n_inner", 100, "n_inner=100 is not supported"),
        ("model_type", "llama", "model_type is 'llama'; only 'gpt2'"),
    ],
)
def test_hf_configs_folio_cannot_represent_are_refused(
    hf_gpt2, bpe_dir: Path, tmp_path: Path, setting: str, value: object, message: str
) -> None:
    src = _hf_copy(hf_gpt2, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config[setting] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match=message.replace("(", "\\(").replace(")", "\\)")):
        convert_hf(src, tmp_path / "out", bpe_dir=bpe_dir)
    assert not (tmp_path / "out").exists()


def test_hf_pickle_weights_are_refused_unread(hf_gpt2, bpe_dir: Path, tmp_path: Path) -> None:
    src = _hf_copy(hf_gpt2, tmp_path)
    (src / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    with pytest.raises(ConvertError, match="pytorch_model.bin but no model.safetensors: those are pickles"):
        convert_hf(src, tmp_path / "out", bpe_dir=bpe_dir)
    assert not marker.exists()


def test_hf_unprefixed_keys_and_mask_buffers(hf_gpt2, tmp_path: Path) -> None:
    """The layout of the hub's original GPT-2 files: no `transformer.` prefix, causal-mask buffers saved."""
    src = _hf_copy(hf_gpt2, tmp_path)
    weights = src / "model.safetensors"
    state = {k.removeprefix("transformer."): v for k, v in load_file(weights).items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8)
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, weights)
    model, reference = load_hf_gpt2(src), load_hf_gpt2(_hf_copy(hf_gpt2, tmp_path / "again"))
    idx = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(idx), reference(idx))


def test_hf_small_vocabulary_is_refused(hf_gpt2, bpe: Path, tmp_path: Path) -> None:
    src = _hf_copy(hf_gpt2, tmp_path)
    with pytest.raises(ConvertError, match="vocab_size 100 is smaller than GPT-2's BPE \\(50257 tokens\\)"):
        convert_hf(src, tmp_path / "out", bpe_dir=bpe)


def test_hf_other_refusals(hf_gpt2, bpe_dir: Path, tmp_path: Path) -> None:
    src = _hf_copy(hf_gpt2, tmp_path)
    with pytest.raises(ConvertError, match="is the source directory"):
        convert_hf(src, src, bpe_dir=bpe_dir)
    with pytest.raises(ConvertError, match="Hugging Face model directory not found"):
        convert_hf(tmp_path / "nowhere", tmp_path / "out")
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), "n_embd": 32}))
    with pytest.raises(ConvertError, match=r"transformer.wte.weight has shape \(100, 16\) .* needs \(100, 32\)"):
        convert_hf(src, tmp_path / "out", bpe_dir=bpe_dir)
    (src / "config.json").unlink()
    with pytest.raises(ConvertError, match="config.json is missing"):
        convert_hf(src, tmp_path / "out", bpe_dir=bpe_dir)


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ tools | tojson }}")


def test_hf_keeps_the_repos_chat_template(hf_small, gpt2_tok: BPETokenizer, bpe: Path, tmp_path: Path) -> None:
    """A repo whose tokenizer transformers saved with a chat template (chat_template.jinja): the checkpoint carries
    it, and renders a conversation as transformers does from the repo."""
    transformers = pytest.importorskip("transformers")
    src, _ = hf_small
    hf_tok = transformers.GPT2Tokenizer(str(bpe / "encoder.json"), str(bpe / "vocab.bpe"))
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(src)
    assert (src / "chat_template.jinja").is_file()
    ckpt = load_checkpoint(convert_hf(src, tmp_path / "out", bpe_dir=bpe))
    assert ckpt.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Héllo <b>"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "<é>"}}]
    want = transformers.AutoTokenizer.from_pretrained(src).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)
    got = ChatTemplate(ckpt.chat_template, "checkpoint").render(messages, tools=tools,
                                                                **special_tokens(ckpt.tokenizer))
    assert got == want and got.startswith("<|endoftext|><|im_start|>system\nBe kind.")


@pytest.mark.parametrize("stored", [
    CHAT_TEMPLATE,
    [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": CHAT_TEMPLATE}],
], ids=["string", "named-list"])
def test_hf_chat_template_from_tokenizer_config(tmp_path: Path, stored: object) -> None:
    """Older transformers kept the template in tokenizer_config.json: a string, or named templates ('default')."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": stored}))
    assert hf_chat_template(tmp_path) == CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ 'the file wins' }}")
    assert hf_chat_template(tmp_path) == "{{ 'the file wins' }}"


def test_hf_without_a_chat_template(tmp_path: Path) -> None:
    assert hf_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert hf_chat_template(tmp_path) is None


@pytest.mark.parametrize("files, message", [
    ({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "rag", "template": "x"}]})},
     "lists named templates ('rag') and none is named 'default'"),
    ({"tokenizer_config.json": json.dumps({"chat_template": 3})}, "chat_template is a int, not a template's text"),
    ({"tokenizer_config.json": "{not json"}, "tokenizer_config.json is not a JSON object"),
    ({"chat_template.jinja": "{% for m in messages %}"}, "chat_template.jinja does not compile as a Jinja2 chat "
                                                         "template: syntax error at line 1"),
])
def test_hf_chat_template_refusals(tmp_path: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConvertError, match=re.escape(message)):
        hf_chat_template(tmp_path)


def test_cli_error_exits_two(repo: Path, tmp_path: Path) -> None:
    """Through the real entry point: a clear message on stderr and exit status 2, nothing written."""
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "activation_function": "relu"}))
    result = subprocess.run(
        [sys.executable, "-m", "model.convert", "hf", str(src), str(tmp_path / "out")],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "error:" in result.stderr and "activation_function='relu' is not supported" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# --- nanoGPT -------------------------------------------------------------------------------------------------

CHARS = sorted(set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))  # Shakespeare's 65


def _write_nanogpt(model: GPT, path: Path, *, mask_buffers: bool = False) -> Path:
    """What nanoGPT's train.py saves after torch.compile: every key prefixed `_orig_mod.`."""
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    if mask_buffers:  # nanoGPT without flash attention also saves its causal mask as attn.bias
        T = model.config.block_size
        for i in range(model.config.n_layer):
            state[f"_orig_mod.transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    torch.save(
        {
            "model": state,
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
            "model_args": model.config.to_dict(),
            "iter_num": 5000,
            "best_val_loss": torch.tensor(1.4697),
            "config": {"dataset": "shakespeare_char", "batch_size": 64, "compile": True, "learning_rate": 1e-3},
        },
        path,
    )
    return path


def _write_meta(path: Path, chars: list[str]) -> Path:
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    with open(path, "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return path


@pytest.mark.parametrize("mask_buffers", [False, True])
def test_nanogpt_char_model_converts_exactly(tiny_model: GPT, tmp_path: Path, mask_buffers: bool) -> None:
    assert len(CHARS) == 65
    ckpt_pt = _write_nanogpt(tiny_model, tmp_path / "ckpt.pt", mask_buffers=mask_buffers)
    meta = _write_meta(tmp_path / "meta.pkl", CHARS)
    out = convert_nanogpt(ckpt_pt, tmp_path / "out", meta_path=meta)
    ckpt = load_checkpoint(out)
    assert ckpt.config == tiny_model.config
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ckpt.model(idx), tiny_model(idx))
    assert isinstance(ckpt.tokenizer, CharTokenizer)
    assert ckpt.tokenizer.chars == CHARS
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("ROMEO:\nO, she doth teach!")) == "ROMEO:\nO, she doth teach!"
    assert ckpt.training["converted_from"] == "nanogpt"
    assert ckpt.training["source_sha256"] == _sha256(ckpt_pt)


def test_nanogpt_cli(tiny_model: GPT, tmp_path: Path) -> None:
    ckpt_pt = _write_nanogpt(tiny_model, tmp_path / "ckpt.pt")
    meta = _write_meta(tmp_path / "meta.pkl", CHARS)
    assert main(["nanogpt", str(ckpt_pt), str(tmp_path / "out"), "--meta", str(meta)]) == 0
    assert load_checkpoint(tmp_path / "out").tokenizer.chars == CHARS
    assert main(["nanogpt", str(tmp_path / "missing.pt"), str(tmp_path / "out2")]) == 2


def test_nanogpt_without_meta_uses_gpt2_bpe(bpe: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50304, n_layer=1, n_head=1, n_embd=8, bias=False)).eval()
    out = convert_nanogpt(_write_nanogpt(model, tmp_path / "ckpt.pt"), tmp_path / "out", bpe_dir=bpe)
    ckpt = load_checkpoint(out)
    assert isinstance(ckpt.tokenizer, BPETokenizer) and ckpt.tokenizer.n_vocab == 50257
    idx = torch.tensor([[15496, 995, 50256]])
    with torch.no_grad():
        assert torch.equal(ckpt.model(idx), model(idx))


def test_nanogpt_vocabulary_must_fit(tiny_model: GPT, bpe: Path, tmp_path: Path) -> None:
    ckpt_pt = _write_nanogpt(tiny_model, tmp_path / "ckpt.pt")
    meta = _write_meta(tmp_path / "meta.pkl", [*CHARS, "é"])
    with pytest.raises(ConvertError, match="tokenizer has 66 tokens but the model's vocab_size is 65"):
        convert_nanogpt(ckpt_pt, tmp_path / "out", meta_path=meta)
    with pytest.raises(ConvertError, match="50257 tokens but the model's vocab_size is 65; .* pass its meta.pkl"):
        convert_nanogpt(ckpt_pt, tmp_path / "out", bpe_dir=bpe)
    assert not (tmp_path / "out").exists()


def test_malicious_meta_pkl_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    meta = tmp_path / "meta.pkl"
    meta.write_bytes(pickle.dumps({"vocab_size": 1, "itos": {0: _RunsCommand(f"touch {marker}")}}))
    with pytest.raises(ConvertError, match="global '(os|posix).system' is forbidden"):
        read_meta_pkl(meta)
    assert not marker.exists()
    meta.write_bytes(pickle.dumps(os.system))  # a bare reference to os.system
    with pytest.raises(ConvertError, match="is forbidden"):
        read_meta_pkl(meta)


def test_malformed_meta_pkl(tmp_path: Path) -> None:
    meta = tmp_path / "meta.pkl"
    meta.write_bytes(pickle.dumps({"vocab_size": 2, "itos": {0: "a", 2: "b"}}))
    with pytest.raises(ConvertError, match="keys must be the token ids 0..1"):
        read_meta_pkl(meta)
    meta.write_bytes(pickle.dumps({"vocab_size": 2, "itos": {0: "a", 1: "b"}, "stoi": {"a": 1, "b": 0}}))
    with pytest.raises(ConvertError, match="'stoi' is not the inverse of 'itos'"):
        read_meta_pkl(meta)
    meta.write_bytes(pickle.dumps({"vocab_size": 2, "itos": {0: "a", 1: "b"}})[:-5])
    with pytest.raises(ConvertError, match="is not a readable pickle"):
        read_meta_pkl(meta)


def test_malicious_ckpt_pt_is_refused_without_running_it(tiny_model: GPT, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt_pt = tmp_path / "ckpt.pt"
    torch.save({"model": tiny_model.state_dict(), "model_args": _RunsCommand(f"touch {marker}")}, ckpt_pt)
    with pytest.raises(ConvertError, match="refused by torch.load\\(weights_only=True\\)"):
        convert_nanogpt(ckpt_pt, tmp_path / "out", meta_path=_write_meta(tmp_path / "meta.pkl", CHARS))
    assert not marker.exists()
