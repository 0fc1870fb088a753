"""Self-describing checkpoints: a directory of `model.safetensors` plus `config.json`.

`config.json` holds the model config under nanoGPT's `GPTConfig` names, the tokenizer (kind plus what it
needs; a BPE tokenizer's ranks sit beside it in `tokenizer.tiktoken`) and training provenance. Resume state
(optimizer, RNG, step) is a separate `resume.pt` written by the trainer. Loading validates everything and
never unpickles.

Saving over an existing checkpoint (the trainer rewrites its best one in place) is crash-safe. Every file is
written atomically (temp file, fsync, rename), and weights and config, which must agree (config.json records
the weights' sha256), are committed as a pair: the new config is first written as `config.next.json`, then
the weights are renamed into place, then the config. A crash between those two renames leaves new weights
beside the old config; `read_config` then finds that `config.next.json` records the weights' sha256 and rolls
forward to it. Before that point the old pair is intact, after it the new one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import GPTConfig, machine_memory, si
from model.files import atomic_path, atomic_write_json, fsync_dir, sha256_file
from model.gpt import GPT
from model.tokenizer import BPETokenizer, CharTokenizer, TokenizerError, tokenizer_from_config

FORMAT = "folio-checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
NEXT_CONFIG_FILE = "config.next.json"  # the config of a save in progress (see the module docstring)
TIED_KEYS = ("lm_head.weight",)  # stored once, as transformer.wte.weight


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


@dataclass
class Checkpoint:
    path: Path
    config: GPTConfig
    tokenizer: CharTokenizer | BPETokenizer
    model: GPT
    meta: dict[str, Any] = field(default_factory=dict)  # the whole config.json

    @property
    def training(self) -> dict[str, Any]:
        return self.meta.get("training", {})


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: GPT,
    tokenizer: CharTokenizer | BPETokenizer,
    *,
    training: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    quantization: str = "none",
) -> Path:
    """Write weights, tokenizer and config.json into `directory` (created if needed). `quantization` names what
    `model.quantize` did to `model` ("int8": its linears are `Int8Linear`s); it is recorded in config.json so the
    weights load as they are, without quantizing again."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer.n_vocab > model.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.n_vocab} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    # unwrap torch.compile / DDP wrappers, copy to CPU, store tied weights once
    raw = getattr(model, "_orig_mod", model)
    raw = getattr(raw, "module", raw)
    tensors = {
        k: (v.detach().to("cpu", dtype=dtype) if dtype else v.detach().cpu()).contiguous()
        for k, v in raw.state_dict().items()
        if k not in TIED_KEYS
    }
    weights, next_config = directory / WEIGHTS_FILE, directory / NEXT_CONFIG_FILE
    try:
        with atomic_path(weights) as tmp:  # renamed into place (and the directory synced) when the block ends
            save_file(tensors, tmp, metadata={"format": "pt", "producer": "folio"})
            tokenizer.save(directory)
            config = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "model": raw.config.to_dict(),
                "tokenizer": tokenizer.to_config(),
                "weights_sha256": sha256_file(tmp),
                "training": training or {},
            }
            if quantization != "none":
                config["quantization"] = quantization
            atomic_write_json(next_config, config)
    except BaseException:
        next_config.unlink(missing_ok=True)  # the old pair is intact; the pending config would only mislead
        raise
    os.replace(next_config, directory / CONFIG_FILE)  # the weights' rename reached the disk first
    fsync_dir(directory)
    return directory


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse and check `config.json` (or `config.next.json`, where a save was cut short between renaming its
    weights and its config into place); raises `CheckpointError` saying what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    path, pending, weights = directory / CONFIG_FILE, directory / NEXT_CONFIG_FILE, directory / WEIGHTS_FILE
    meta = _parse_config(path) if path.is_file() else None
    if pending.is_file() and weights.is_file():
        try:
            next_meta = _parse_config(pending)
        except CheckpointError:
            next_meta = None
        got = sha256_file(weights)
        if next_meta and next_meta.get("weights_sha256") == got and (meta or {}).get("weights_sha256") != got:
            return next_meta
    if meta is None:
        raise CheckpointError(f"{path} is missing: a Folio checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    return meta


def _parse_config(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e.strerror or e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Folio checkpoint config (expected \"format\": \"{FORMAT}\")")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {meta.get('format_version')!r}; this Folio reads {FORMAT_VERSION}"
        )
    for key in ("model", "tokenizer"):
        if key not in meta:
            raise CheckpointError(f"{path} has no '{key}' section")
    return meta


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Checkpoint:
    """Load and validate a checkpoint; the model comes back in eval mode on `device`."""
    directory = Path(directory)
    meta = read_config(directory)
    try:
        config = GPTConfig.from_dict(meta["model"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: bad model config: {e}") from None
    try:
        tokenizer = tokenizer_from_config(meta["tokenizer"], directory)
    except TokenizerError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    if tokenizer.n_vocab > config.vocab_size:
        raise CheckpointError(
            f"{directory}: tokenizer has {tokenizer.n_vocab} tokens but vocab_size is {config.vocab_size}"
        )
    quantization = meta.get("quantization", "none")
    state = load_weights(directory / WEIGHTS_FILE, config, device=device, quantization=quantization)
    want = meta.get("weights_sha256")
    if want and (got := sha256_file(directory / WEIGHTS_FILE)) != want:
        raise CheckpointError(
            f"{directory / WEIGHTS_FILE} has sha256 {got}, but {CONFIG_FILE} records {want}: the weights were "
            "corrupted or replaced after the checkpoint was written"
        )
    for name, t in state.items():  # after the hash: damaged bytes are reported as damage, not as the NaNs they make
        if name not in TIED_KEYS:
            _check_finite(directory / WEIGHTS_FILE, name, t)
    model = _empty_model(config, quantization)
    model.load_state_dict(state, assign=True, strict=True)
    if quantization == "none":
        model.lm_head.weight = model.transformer.wte.weight  # re-tie after assign
    if dtype is not None:
        model.to(dtype=dtype)
    model.eval()
    return Checkpoint(path=directory, config=config, tokenizer=tokenizer, model=model, meta=meta)


def _empty_model(config: GPTConfig, quantization: str) -> GPT:
    """`config`'s model on the meta device, with the modules `quantization` puts in (its state dict's names)."""
    from model.quantize import QUANTIZATIONS, quantize  # lazily: model.quantize reaches into the kernels

    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"{CONFIG_FILE}: quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    with torch.device("meta"):
        model = GPT(config)
        quantize(model, quantization)
    return model


def load_weights(
    path: Path, config: GPTConfig, *, device: torch.device | str = "cpu", quantization: str = "none"
) -> dict[str, torch.Tensor]:
    """Read `model.safetensors`, checking its size against what `config` implies (before building anything),
    then names, shapes and dtypes against what `config` builds (quantized as `quantization` says)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            keys = set(f.keys())
            _check_size(path, config, {k: f.get_slice(k).get_shape() for k in keys - set(TIED_KEYS)})
            model = _empty_model(config, quantization)
            expected = {k: v for k, v in model.state_dict().items() if k not in TIED_KEYS}
            missing, unexpected = sorted(set(expected) - keys), sorted(keys - set(expected) - set(TIED_KEYS))
            if missing or unexpected:
                raise CheckpointError(
                    f"{path} does not match the model config: missing {missing[:5]}"
                    f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                    f"{' ...' if len(unexpected) > 5 else ''}"
                )
            for k, want in expected.items():
                t = f.get_tensor(k)
                if tuple(t.shape) != tuple(want.shape):
                    raise CheckpointError(
                        f"{path}: tensor {k} has shape {tuple(t.shape)}, the config needs {tuple(want.shape)}"
                    )
                floating = want.is_floating_point()  # any float type; an int8 weight must be int8
                if t.is_floating_point() != floating or (not floating and t.dtype != want.dtype):
                    expected_dtype = "a float type" if floating else want.dtype
                    raise CheckpointError(f"{path}: tensor {k} has dtype {t.dtype}, expected {expected_dtype}")
                state[k] = t
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated, corrupted, or a "
            "pickle renamed to .safetensors (Folio never unpickles checkpoints; convert it with "
            "`python -m model.convert`)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e}") from None
    if quantization == "none":
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def _check_size(path: Path, config: GPTConfig, shapes: dict[str, list[int]]) -> None:
    """The config against the weights' header (`shapes`: read without loading a tensor) and this machine's
    memory, before any module is built even on the meta device: a config claiming 100,000 layers would otherwise
    take a minute and gigabytes to build before the first tensor is compared. A smaller mismatch (fewer layers,
    other widths) is left to the comparison tensor by tensor, which names the tensor."""
    held = sum(math.prod(shape) for shape in shapes.values())
    layers = len({k.split(".")[2] for k in shapes if k.startswith("transformer.h.")})
    with open(path, "rb") as f:  # tensor bytes: the file less its 8-byte length and JSON header
        stored = path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    sizes = f"{path.name} holds {si(held)} parameters in {layers} layers ({si(stored)}B)"
    try:
        config.check_memory(stored / held if held else 4, machine_memory(), "loading it")
    except ValueError as e:
        raise CheckpointError(f"{path.parent / CONFIG_FILE}: {e}; {sizes}") from None
    if config.n_layer > layers:
        raise CheckpointError(
            f"{path} does not match the model config: {CONFIG_FILE} describes n_layer {config.n_layer} "
            f"({si(config.num_params())} parameters), but {sizes}"
        )


def _check_finite(path: Path, name: str, t: torch.Tensor) -> None:
    """Refuse NaN or infinite weights (a diverged run): they load, then every stream gives NaN logprobs. One sum
    over the tensor, nothing copied; only a non-finite sum (also a finite tensor whose sum overflows) is looked
    at element by element."""
    if torch.isfinite(t.sum()) or not (bad := int((~torch.isfinite(t)).sum())):
        return
    raise CheckpointError(
        f"{path}: tensor {name} holds {bad} NaN or infinite value(s) of {t.numel()}: these weights cannot "
        "generate (a training run that diverged?); retrain, or serve an earlier checkpoint"
    )
