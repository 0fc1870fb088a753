"""Training data: text -> token ids in a uint16/uint32 memmap (first 90% train, last 10% val), cached
beside the output, and random-window batches drawn with an explicit `torch.Generator`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.tokenizer import BPETokenizer, CharTokenizer, TokenizerError, gpt2_tokenizer

TRAIN_FRACTION = 0.9


class DataError(ValueError):
    """Training text that cannot be used; the message says why."""


@dataclass
class Dataset:
    train: np.ndarray  # memmap of token ids
    val: np.ndarray
    tokenizer: CharTokenizer | BPETokenizer
    sha256: str  # of the raw text file

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of split 'train' or 'val' (`get_batch`)."""
        return get_batch(self.train if split == "train" else self.val, batch_size, block_size, generator, device)


def read_text(path: str | Path) -> tuple[str, str]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"data file is empty: {path}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file is not UTF-8 text: {path} ({e})") from None
    return text, hashlib.sha256(raw).hexdigest()


def prepare(
    data_path: str | Path,
    cache_dir: str | Path,
    *,
    tokenizer: str | CharTokenizer | BPETokenizer = "char",
    bpe_dir: str | None = None,
    block_size: int,
) -> Dataset:
    """Tokenize `data_path` once into `cache_dir/{train,val}.bin`; reuse the cache while the text's sha256
    and the tokenizer are unchanged. Refuses a text too short to give one block in each split. `tokenizer` is
    'char' (the text's characters), 'gpt2' (BPE) or a tokenizer itself (a fine-tuned model's)."""
    text, sha = read_text(data_path)
    tok = make_tokenizer(tokenizer, text, bpe_dir)
    dtype = np.uint16 if tok.n_vocab <= 2**16 else np.uint32
    cache_dir = Path(cache_dir)
    meta_path = cache_dir / "meta.json"
    want_meta = {"sha256": sha, "tokenizer": tok.to_config(), "dtype": np.dtype(dtype).name}
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            meta = {}
        if all(meta.get(k) == v for k, v in want_meta.items()):
            return Dataset(
                np.memmap(cache_dir / "train.bin", dtype=dtype, mode="r"),
                np.memmap(cache_dir / "val.bin", dtype=dtype, mode="r"),
                tok,
                sha,
            )
    n = len(text)
    split = int(n * TRAIN_FRACTION)
    parts = {"train": text[:split], "val": text[split:]}
    cache_dir.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, part in parts.items():
        try:
            ids = np.array(tok.encode(part), dtype=dtype)
        except TokenizerError as e:
            raise DataError(f"{data_path}: the model's tokenizer cannot encode the {name} split: {e}") from None
        if len(ids) <= block_size:
            raise DataError(
                f"{data_path}: the {name} split has {len(ids)} tokens, fewer than one block "
                f"(block_size {block_size} + 1); use a longer text or a smaller --block-size"
            )
        ids.tofile(cache_dir / f"{name}.bin")
        arrays[name] = np.memmap(cache_dir / f"{name}.bin", dtype=dtype, mode="r")
    meta_path.write_text(json.dumps({**want_meta, "train_tokens": len(arrays["train"]),
                                     "val_tokens": len(arrays["val"])}))
    return Dataset(arrays["train"], arrays["val"], tok, sha)


def make_tokenizer(tokenizer: str | CharTokenizer | BPETokenizer, text: str,
                   bpe_dir: str | None) -> CharTokenizer | BPETokenizer:
    """The tokenizer named ('char': built from `text`'s characters; 'gpt2': BPE), or the one given."""
    if not isinstance(tokenizer, str):
        return tokenizer
    if tokenizer == "char":
        return CharTokenizer.from_text(text)
    if tokenizer == "gpt2":
        return gpt2_tokenizer(bpe_dir)
    raise DataError(f"unknown tokenizer {tokenizer!r}; expected 'char' or 'gpt2'")


def get_batch(
    data: np.ndarray,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (B, T) and the same windows shifted one token as targets (B, T)."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator).tolist()
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
