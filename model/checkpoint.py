"""Self-describing checkpoints: a directory of `model.safetensors` plus `config.json`.

`config.json` holds the model config under nanoGPT's `GPTConfig` names, the tokenizer (kind plus what it
needs; a BPE tokenizer's ranks sit beside it in `tokenizer.tiktoken`) and training provenance. Resume state
(optimizer, RNG, step) is a separate `resume.pt` written by the trainer. Every file is written atomically
(temp file, fsync, rename), weights before config. Loading validates everything and never unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import BPETokenizer, CharTokenizer, TokenizerError, tokenizer_from_config

FORMAT = "folio-checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path` to write to; on success it is fsynced and renamed over `path`, so a
    crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: GPT,
    tokenizer: CharTokenizer | BPETokenizer,
    *,
    training: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write weights, tokenizer and config.json into `directory` (created if needed)."""
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
    weights = directory / WEIGHTS_FILE
    atomic_save_tensors(weights, tensors, metadata={"format": "pt", "producer": "folio"})
    tokenizer.save(directory)
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": raw.config.to_dict(),
        "tokenizer": tokenizer.to_config(),
        "weights_sha256": sha256_file(weights),
        "training": training or {},
    }
    atomic_write_json(directory / CONFIG_FILE, config)
    return directory


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse and check `config.json`; raises `CheckpointError` saying what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a Folio checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
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
    state = load_weights(directory / WEIGHTS_FILE, config, device=device)
    want = meta.get("weights_sha256")
    if want and (got := sha256_file(directory / WEIGHTS_FILE)) != want:
        raise CheckpointError(
            f"{directory / WEIGHTS_FILE} has sha256 {got}, but {CONFIG_FILE} records {want}: the weights were "
            "corrupted or replaced after the checkpoint was written"
        )
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.lm_head.weight = model.transformer.wte.weight  # re-tie after assign
    if dtype is not None:
        model.to(dtype=dtype)
    model.eval()
    return Checkpoint(path=directory, config=config, tokenizer=tokenizer, model=model, meta=meta)


def load_weights(
    path: Path, config: GPTConfig, *, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Read `model.safetensors`, checking names, shapes and dtypes against what `config` builds."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    with torch.device("meta"):
        expected = {k: v for k, v in GPT(config).state_dict().items() if k not in TIED_KEYS}
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            keys = set(f.keys())
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
                if not t.is_floating_point():
                    raise CheckpointError(f"{path}: tensor {k} has dtype {t.dtype}, expected a float type")
                state[k] = t
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated, corrupted, or a "
            "pickle renamed to .safetensors (Folio never unpickles checkpoints; convert it with "
            "`python -m model.convert`)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e}") from None
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state
