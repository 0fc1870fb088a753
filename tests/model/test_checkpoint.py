"""Checkpoints: exact round trips, a specific refusal for every kind of damage, and atomic writes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import checkpoint
from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.config import GPTConfig, si
from model.files import atomic_write_bytes
from model.gpt import GPT
from model.tokenizer import BPE_FILE, BPETokenizer, CharTokenizer

CHARS = [chr(c) for c in range(32, 32 + 64)] + ["\n"]  # 65 characters, tiny_config's vocab_size


@pytest.fixture
def char_tok() -> CharTokenizer:
    return CharTokenizer(CHARS)


@pytest.fixture
def saved(tmp_path: Path, tiny_model: GPT, char_tok: CharTokenizer) -> Path:
    return save_checkpoint(tmp_path / "ckpt", tiny_model, char_tok, training={"step": 7})


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _logits(model: GPT) -> torch.Tensor:
    idx = torch.arange(32).reshape(2, 16) * 3 % 65
    with torch.no_grad():
        return model(idx)


def test_round_trip_gives_identical_logits(saved: Path, tiny_model: GPT, char_tok: CharTokenizer) -> None:
    ckpt = load_checkpoint(saved)
    assert ckpt.config == tiny_model.config
    assert not ckpt.model.training
    assert ckpt.model.lm_head.weight is ckpt.model.transformer.wte.weight
    assert torch.equal(_logits(ckpt.model), _logits(tiny_model))
    assert isinstance(ckpt.tokenizer, CharTokenizer) and ckpt.tokenizer.chars == char_tok.chars
    assert ckpt.training == {"step": 7}
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]


# --- refusals ------------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere")


def test_missing_config(saved: Path) -> None:
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_checkpoint(saved)


def test_malformed_json(saved: Path) -> None:
    (saved / "config.json").write_text('{"format": "folio-checkpoint",')
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_checkpoint(saved)


def test_unreadable_config(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read_bytes = Path.read_bytes

    def denied(self: Path) -> bytes:  # what a file of another user gives
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(CheckpointError, match="config.json could not be read: Permission denied"):
        load_checkpoint(saved)


def test_wrong_format_field(saved: Path) -> None:
    _edit_config(saved, lambda m: m.update(format="hf-transformers"))
    with pytest.raises(CheckpointError, match='is not a Folio checkpoint config \\(expected "format"'):
        load_checkpoint(saved)


def test_missing_weights(saved: Path) -> None:
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_checkpoint(saved)


def test_truncated_weights(saved: Path) -> None:
    weights = saved / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        load_checkpoint(saved)


def test_pickle_renamed_to_safetensors_is_never_unpickled(saved: Path, tiny_model: GPT) -> None:
    torch.save(tiny_model.state_dict(), saved / "model.safetensors")
    with pytest.raises(CheckpointError, match="is not a readable safetensors file") as e:
        load_checkpoint(saved)
    assert "never unpickles" in str(e.value) and "python -m model.convert" in str(e.value)


def test_corrupted_tensor_bytes_are_caught_by_the_recorded_sha256(saved: Path) -> None:
    # a flipped byte inside tensor data still parses as safetensors; only the hash notices
    weights = saved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted or replaced"):
        load_checkpoint(saved)


def test_shapes_that_disagree_with_the_config(saved: Path) -> None:
    _edit_config(saved, lambda m: m["model"].update(n_embd=64))  # the weights are n_embd 32
    with pytest.raises(CheckpointError, match=r"wte.weight has shape \(65, 32\), the config needs \(65, 64\)"):
        load_checkpoint(saved)


# --- a file that changes while it is loaded or served -------------------------------------------------------


@pytest.fixture
def other_weights(tmp_path: Path, tiny_model: GPT, char_tok: CharTokenizer) -> Path:
    """A checkpoint of the same shape with other weights (its files the same sizes)."""
    torch.manual_seed(99)
    return save_checkpoint(tmp_path / "other", GPT(tiny_model.config).eval(), char_tok)


def test_a_loaded_model_never_reads_its_file_again(saved: Path, other_weights: Path, tiny_model: GPT) -> None:
    """A plain `cp` writes over the served file in place (the same inode): weights read through a memory map of it
    changed under the model, and a truncated file ended the process with SIGBUS."""
    ckpt = load_checkpoint(saved)
    shutil.copyfile(other_weights / "model.safetensors", saved / "model.safetensors")  # truncate, then write
    assert torch.equal(_logits(ckpt.model), _logits(tiny_model))
    os.truncate(saved / "model.safetensors", 0)
    assert torch.equal(_logits(ckpt.model), _logits(tiny_model))


def test_weights_replaced_while_being_loaded_are_refused_never_mixed(
    saved: Path, other_weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json already the new one, the weights renamed into place while the loader works: the hash must be of
    the bytes the tensors were made of. Read a second time, the file matched the new config.json while the model
    held the old weights, and was served under the new weights' name."""
    shutil.copyfile(other_weights / "config.json", saved / "config.json")
    build = checkpoint._empty_model

    def the_new_weights_land(*args: object) -> GPT:
        incoming = shutil.copyfile(other_weights / "model.safetensors", saved / "incoming")
        os.replace(incoming, saved / "model.safetensors")
        return build(*args)

    monkeypatch.setattr(checkpoint, "_empty_model", the_new_weights_land)
    with pytest.raises(CheckpointError, match="corrupted or replaced after the checkpoint was written"):
        load_checkpoint(saved)
    monkeypatch.undo()
    assert torch.equal(_logits(load_checkpoint(saved).model), _logits(load_checkpoint(other_weights).model))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(
    tmp_path: Path, tiny_model: GPT, char_tok: CharTokenizer, value: float
) -> None:
    # saved normally (config.json records these weights' sha256), as a run that diverged would save them
    with torch.no_grad():
        tiny_model.transformer.h[1].mlp.c_fc.weight[3, 5] = value
    directory = save_checkpoint(tmp_path / "diverged", tiny_model, char_tok)
    with pytest.raises(CheckpointError, match=r"tensor transformer\.h\.1\.mlp\.c_fc\.weight holds 1 NaN or "
                       r"infinite value\(s\) of 4096"):
        load_checkpoint(directory)


def test_finite_half_precision_weights_whose_sum_overflows_still_load(
    tmp_path: Path, tiny_model: GPT, char_tok: CharTokenizer
) -> None:
    # the finiteness check sums each tensor; 65 x 32 values of 60000 sum past float16's range (65504), yet
    # every value is finite: the element-by-element look that follows must let it through
    with torch.no_grad():
        tiny_model.transformer.wte.weight.fill_(60000.0)
    directory = save_checkpoint(tmp_path / "half", tiny_model, char_tok, dtype=torch.float16)
    assert torch.isinf(load_checkpoint(directory).model.transformer.wte.weight.sum())  # the sum did overflow
    assert load_checkpoint(directory).model.transformer.wte.weight.eq(60000.0).all()


@pytest.fixture
def nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a GPT module is built, even on the meta device: huge configs must be refused first."""
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("a GPT was built before the config was checked against the weights")

    monkeypatch.setattr(GPT, "__init__", refuse)


def _sizes(directory: Path) -> tuple[int, int]:
    """(parameters the config implies, parameters the weights file holds), without building a model."""
    config = GPTConfig.from_dict(json.loads((directory / "config.json").read_text())["model"])
    return config.num_params(), sum(t.numel() for t in load_file(directory / "model.safetensors").values())


@pytest.mark.parametrize("memory", [1 << 40, 1 << 30])  # 1 TiB: past the memory check; 1 GiB: stopped by it
def test_a_config_with_far_more_layers_is_refused_before_building(
    saved: Path, nothing_is_built: None, monkeypatch: pytest.MonkeyPatch, memory: int
) -> None:
    monkeypatch.setattr(checkpoint, "machine_memory", lambda: memory)
    _edit_config(saved, lambda m: m["model"].update(n_layer=100_000))
    implied, held = _sizes(saved)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    message = str(e.value)
    assert f"n_layer 100000 ({si(implied)} parameters)" in message or f"has {si(implied)} parameters" in message
    assert f"model.safetensors holds {si(held)} parameters in 2 layers" in message
    assert ("more than this machine's 1.07GB of memory" in message) == (memory == 1 << 30), message


def test_a_config_with_a_huge_width_is_refused_before_building(saved: Path, nothing_is_built: None) -> None:
    _edit_config(saved, lambda m: m["model"].update(n_embd=10**9, n_head=1))
    implied, held = _sizes(saved)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    message = str(e.value)
    assert f"n_embd 1000000000, vocab_size 65, block_size 32) has {si(implied)} parameters" in message
    assert f"loading it needs at least {si(implied * 4)}B, more than this machine's" in message
    assert f"model.safetensors holds {si(held)} parameters in 2 layers" in message


def test_unknown_tokenizer_kind(saved: Path) -> None:
    _edit_config(saved, lambda m: m["tokenizer"].update(kind="sentencepiece"))
    with pytest.raises(CheckpointError, match="unknown tokenizer kind 'sentencepiece'"):
        load_checkpoint(saved)


def test_tokenizer_bigger_than_vocab_size(saved: Path) -> None:
    _edit_config(saved, lambda m: m["tokenizer"].update(chars=[*CHARS, "é"]))
    with pytest.raises(CheckpointError, match="tokenizer has 66 tokens but vocab_size is 65"):
        load_checkpoint(saved)


def test_save_refuses_tokenizer_bigger_than_vocab_size(tmp_path: Path, tiny_model: GPT) -> None:
    with pytest.raises(CheckpointError, match="tokenizer has 66 tokens but the model's vocab_size is 65"):
        save_checkpoint(tmp_path, tiny_model, CharTokenizer([*CHARS, "é"]))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def bpe_saved(tmp_path: Path, gpt2_tok: BPETokenizer) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50304, n_layer=1, n_head=1, n_embd=8))
    return save_checkpoint(tmp_path / "bpe", model, gpt2_tok)


def test_missing_tokenizer_file(bpe_saved: Path) -> None:
    (bpe_saved / BPE_FILE).unlink()
    with pytest.raises(CheckpointError, match="BPE tokenizer file missing: .*tokenizer.tiktoken"):
        load_checkpoint(bpe_saved)


def test_tampered_tokenizer_file(bpe_saved: Path) -> None:
    path = bpe_saved / BPE_FILE
    path.write_bytes(path.read_bytes().replace(b" 0\n", b" 1\n", 1))
    with pytest.raises(CheckpointError, match="tokenizer.tiktoken has sha256 .*, config.json says"):
        load_checkpoint(bpe_saved)


# --- atomic writes -------------------------------------------------------------------------------------------


def test_save_leaves_no_temp_files(saved: Path, tiny_model: GPT, char_tok: CharTokenizer) -> None:
    save_checkpoint(saved, tiny_model, char_tok)  # overwrite in place
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]


def test_crash_during_save_keeps_the_previous_checkpoint(
    saved: Path, tiny_model: GPT, char_tok: CharTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    torch.manual_seed(99)
    other = GPT(tiny_model.config).eval()

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(saved, other, char_tok)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before  # no temp file left, nothing changed
    assert torch.equal(_logits(load_checkpoint(saved).model), _logits(tiny_model))


def test_atomic_write_bytes_replaces_or_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.json"
    atomic_write_bytes(path, b"old")
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        atomic_write_bytes(path, b"half-written")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_crash_between_the_weights_and_config_renames_rolls_forward(
    saved: Path, tiny_model: GPT, char_tok: CharTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the new weights are in place and before the new config is: the checkpoint still loads,
    as the new one (config.next.json records the weights' sha256); the next save tidies up."""
    torch.manual_seed(99)
    other = GPT(tiny_model.config).eval()
    real_replace = os.replace

    def replace(src: object, dst: object) -> None:
        if Path(dst).name == "config.json":
            raise OSError("simulated crash between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(OSError, match="between the renames"):
        save_checkpoint(saved, other, char_tok, training={"step": 8})
    monkeypatch.undo()
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "config.next.json", "model.safetensors"]
    ckpt = load_checkpoint(saved)
    assert ckpt.training == {"step": 8}
    assert torch.equal(_logits(ckpt.model), _logits(other))

    save_checkpoint(saved, tiny_model, char_tok, training={"step": 9})
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    assert load_checkpoint(saved).training == {"step": 9}


def test_stale_next_config_is_ignored(saved: Path) -> None:
    """A config.next.json whose sha256 is not the weights' (a save cut short before its weights' rename)."""
    meta = json.loads((saved / "config.json").read_text())
    (saved / "config.next.json").write_text(json.dumps({**meta, "weights_sha256": "0" * 64, "training": {}}))
    assert load_checkpoint(saved).training == {"step": 7}


def test_checkpoint_files_are_readable_by_others_under_the_usual_umask(
    tmp_path: Path, tiny_model: GPT, char_tok: CharTokenizer
) -> None:
    # a server in a container runs as another user than the one who trained the model
    old = os.umask(0o022)
    try:
        saved = save_checkpoint(tmp_path / "ckpt", tiny_model, char_tok)
    finally:
        os.umask(old)
    for f in saved.iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f
