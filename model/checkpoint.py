"""Self-describing checkpoints: a directory of `model.safetensors` plus `config.json`.

`config.json` holds the model config under nanoGPT's `GPTConfig` names, the tokenizer (kind plus what it
needs; a BPE tokenizer's ranks sit beside it in `tokenizer.tiktoken`; the model's chat template, if it has one, as
`tokenizer.chat_template`) and training provenance. Resume state
(optimizer, RNG, step) is a separate `resume.pt` written by the trainer. Loading validates everything, never
unpickles, and reads the weights into memory once, hashing the very bytes it builds tensors from: a served model
never depends on its file staying unchanged (`load_weights`).

Saving over an existing checkpoint (the trainer rewrites its best one in place) is crash-safe. Every file is
written atomically (temp file, fsync, rename), and weights and config, which must agree (config.json records
the weights' sha256), are committed as a pair: the new config is first written as `config.next.json`, then
the weights are renamed into place, then the config. A crash between those two renames leaves new weights
beside the old config; `read_config` then finds that `config.next.json` records the weights' sha256 and rolls
forward to it. Before that point the old pair is intact, after it the new one.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.config import GPTConfig, machine_memory, si
from model.files import atomic_path, atomic_write_json, fsync_dir, sha256_file
from model.gpt import GPT
from model.quantize import QUANTIZATIONS, quantize
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
    config_sha256: str | None = None  # of the config.json bytes the load read (what a hot reload compares)

    @property
    def training(self) -> dict[str, Any]:
        return self.meta.get("training", {})

    @property
    def chat_template(self) -> str | None:
        """The Jinja2 chat template the checkpoint carries (with its tokenizer), if any (model/chat_template.py)."""
        return self.tokenizer.chat_template


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: GPT,
    tokenizer: CharTokenizer | BPETokenizer,
    *,
    training: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    quantization: str = "none",
    calibration: dict[str, Any] | None = None,
) -> Path:
    """Write weights, tokenizer and config.json into `directory` (created if needed). `quantization` names what
    `model.quantize` did to `model` ("int8": its linears are `Int8Linear`s); it is recorded in config.json so the
    weights load as they are, without quantizing again, with `calibration` (how a calibrated quantization chose
    them: model/quantize/gptq.py) beside it."""
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
            if calibration:
                config["calibration"] = calibration
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
    return _read_config(Path(directory))[0]


def _read_config(directory: Path) -> tuple[dict[str, Any], str | None]:
    """`read_config`, with the sha256 of the config.json bytes it read (None: there was none), even where it rolled
    forward to config.next.json: that is what the next look at the directory compares (`ModelRegistry.reload`). A
    config.json being rewritten in place (a plain `cp` over it) is hashed as it was read, not as it is a moment
    later."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    path, pending, weights = directory / CONFIG_FILE, directory / NEXT_CONFIG_FILE, directory / WEIGHTS_FILE
    current = _parse_config(path) if path.is_file() else None
    digest = current[1] if current else None
    if pending.is_file() and weights.is_file():
        try:
            following = _parse_config(pending)[0]
        except CheckpointError:
            following = None
        got = sha256_file(weights)
        current_weights = current[0].get("weights_sha256") if current else None
        if following and following.get("weights_sha256") == got and current_weights != got:
            return following, digest
    if current is None:
        raise CheckpointError(f"{path} is missing: a Folio checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    return current[0], digest


def _parse_config(path: Path) -> tuple[dict[str, Any], str]:
    try:
        raw = path.read_bytes()
        meta = json.loads(raw.decode("utf-8"))
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
    return meta, hashlib.sha256(raw).hexdigest()


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Checkpoint:
    """Load and validate a checkpoint; the model comes back in eval mode on `device`."""
    directory = Path(directory)
    meta, config_sha256 = _read_config(directory)
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
    state = load_weights(directory / WEIGHTS_FILE, config, device=device, quantization=quantization,
                         sha256=meta.get("weights_sha256"))
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
    return Checkpoint(path=directory, config=config, tokenizer=tokenizer, model=model, meta=meta,
                      config_sha256=config_sha256)


def _empty_model(config: GPTConfig, quantization: str) -> GPT:
    """`config`'s model on the meta device, with the modules `quantization` puts in (its state dict's names)."""
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"{CONFIG_FILE}: quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    with torch.device("meta"):
        model = GPT(config)
        quantize(model, quantization)
    return model


def load_weights(
    path: Path, config: GPTConfig, *, device: torch.device | str = "cpu", quantization: str = "none",
    sha256: str | None = None,
) -> dict[str, torch.Tensor]:
    """Read `model.safetensors` into memory, once, through one descriptor: first its header, checked as safetensors
    checks it and against the size `config` implies (and this machine's memory) before anything is read or built;
    then each tensor into memory of its own, the bytes hashed as they are read. On what was read: names, shapes and
    dtypes against what `config` builds (quantized as `quantization` says), then the hash against `sha256` (what
    config.json records). A served model never reads its file again, so a file replaced in place or truncated
    meanwhile (a plain `cp` over it) changes nothing it computes (a memory map of it ended the server with SIGBUS),
    and a file read while it was being written is refused here (its header, its length or its hash disagrees),
    never half loaded."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        tensors, got = _read_weights(path, config)
    except _Unreadable as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated, corrupted, or a "
            "pickle renamed to .safetensors (Folio never unpickles checkpoints; convert it with "
            "`python -m model.convert`)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e}") from None
    model = _empty_model(config, quantization)
    expected = {k: v for k, v in model.state_dict().items() if k not in TIED_KEYS}
    keys = set(tensors)
    missing, unexpected = sorted(set(expected) - keys), sorted(keys - set(expected) - set(TIED_KEYS))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    state: dict[str, torch.Tensor] = {}
    for k, want in expected.items():
        t = tensors[k]
        if tuple(t.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{path}: tensor {k} has shape {tuple(t.shape)}, the config needs {tuple(want.shape)}"
            )
        floating = want.is_floating_point()  # any float type; an int8 weight must be int8
        if t.is_floating_point() != floating or (not floating and t.dtype != want.dtype):
            expected_dtype = "a float type" if floating else want.dtype
            raise CheckpointError(f"{path}: tensor {k} has dtype {t.dtype}, expected {expected_dtype}")
        state[k] = t
    if sha256 and got != sha256:
        raise CheckpointError(
            f"{path} has sha256 {got}, but {CONFIG_FILE} records {sha256}: the weights were corrupted or replaced "
            "after the checkpoint was written (or are being written now)"
        )
    if torch.device(device).type != "cpu":
        state = {k: t.to(device) for k, t in state.items()}
    if quantization == "none":
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


class _Unreadable(ValueError):
    """Bytes that are not a safetensors file (the message says what is wrong with them)."""


# safetensors' dtype names, as torch knows them
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# a tensor this large is read into an anonymous mapping of its own, which goes back to the system whole once the
# tensor is freed; from the heap, a retired engine's weights left a few copies' worth of RSS behind over five
# reloads (malloc keeps what it grew by, and raises its mmap threshold to the size of each block freed)
MAPPED_TENSOR_BYTES = 1 << 20
_Entry = tuple[int, int, str, torch.dtype, list[int]]  # a tensor's (start, end) in the data, name, dtype and shape


def _read_weights(path: Path, config: GPTConfig) -> tuple[dict[str, torch.Tensor], str]:
    """The file's tensors, each read into memory of its own (MAPPED_TENSOR_BYTES), and the sha256 of every byte read
    (the header too)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if size < 8 or len(first) < 8:
            raise _Unreadable(f"{size} bytes, fewer than the 8 of the header's length")
        n = int.from_bytes(first, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise _Unreadable(f"the header's length, {n} bytes, is more than the file's {size} bytes or "
                              f"safetensors' limit of {MAX_HEADER_BYTES}")
        raw = f.read(n)
        entries = _entries(raw, size - 8 - n)
        _check_size(path, config, {name: shape for _, _, name, _, shape in entries if name not in TIED_KEYS},
                    size - 8 - n)
        digest = hashlib.sha256(first + raw)
        tensors = {}
        for start, end, name, dtype, shape in entries:
            memory = mmap.mmap(-1, end - start) if end - start >= MAPPED_TENSOR_BYTES else bytearray(end - start)
            into, got = memoryview(memory), 0
            while got < end - start and (k := f.readinto(into[got:])):
                got += k
            if got < end - start:
                raise _Unreadable(f"it is shorter than its header says ({size} bytes when it was opened): it "
                                  "was cut short while it was read, or is being written")
            digest.update(into)
            into.release()
            tensors[name] = torch.frombuffer(memory, dtype=dtype).reshape(shape) if memory else torch.empty(
                shape, dtype=dtype)
    return tensors, digest.hexdigest()


def _entries(raw: bytes, data_bytes: int) -> list[_Entry]:
    """The tensors a safetensors header (`raw`, JSON) lists, in the order of their bytes; checked as safetensors
    checks a file: known dtypes, each tensor's bytes as many as its shape needs, one after another to the end of
    the file's `data_bytes` bytes of tensor data."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Unreadable(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _Unreadable("the header is not a JSON object")
    header.pop("__metadata__", None)
    entries: list[_Entry] = []
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = SAFETENSORS_DTYPES.get(entry["dtype"]), entry["shape"], entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in (*shape, start, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise _Unreadable(f"the header's entry for {name!r} is not a tensor's (dtype, shape, data_offsets): "
                              f"{str(entry)[:100]}") from None
        if dtype is None:
            raise _Unreadable(f"tensor {name} has dtype {entry['dtype']!r}, not one of {sorted(SAFETENSORS_DTYPES)}")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise _Unreadable(f"tensor {name} of shape {shape} ({entry['dtype']}) has {end - start} bytes")
        entries.append((start, end, name, dtype, shape))
    entries.sort(key=lambda e: e[:2])
    at = 0
    for start, end, name, _, _ in entries:
        if start != at:
            raise _Unreadable(f"tensor {name}'s bytes begin at {start}, not where the previous one ends ({at})")
        at = end
    if at != data_bytes:
        raise _Unreadable(f"its header lists {at} bytes of tensors, the file holds {data_bytes}")
    return entries


def _check_size(path: Path, config: GPTConfig, shapes: dict[str, list[int]], stored: int) -> None:
    """The config against the weights' header (`shapes`: read without loading a tensor; `stored`: the bytes of
    its tensors) and this machine's memory, before any module is built even on the meta device: a config claiming
    100,000 layers would otherwise take a minute and gigabytes to build before the first tensor is compared. A
    smaller mismatch (fewer layers, other widths) is left to the comparison tensor by tensor, which names the
    tensor."""
    held = sum(math.prod(shape) for shape in shapes.values())
    layers = len({k.split(".")[2] for k in shapes if k.startswith("transformer.h.")})
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
