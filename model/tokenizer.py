"""Tokenizers: character level (vocabulary stored in the checkpoint) and GPT-2 BPE through tiktoken.

Both map text to token ids and back, and expose `decode_bytes` so a streamer can hold back bytes until
they form whole UTF-8 characters (byte-level BPE can split a character across tokens). A checkpoint carries
its tokenizer: the character list inline in `config.json`, the BPE ranks in a `tokenizer.tiktoken` file
beside it, so loading never touches the network. A tokenizer also carries its model's chat template, if it has one
(`chat_template`, the Jinja2 text Hugging Face keeps in `tokenizer_config.json`; rendered by model/chat_template.py),
stored with the rest of its config.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any, Protocol

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from model.files import atomic_write_bytes

GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_PUBLIC_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main"
BPE_FILE = "tokenizer.tiktoken"


class TokenizerError(ValueError):
    """Text or ids the tokenizer cannot handle; the message says which and why."""


class Tokenizer(Protocol):
    n_vocab: int
    eos_id: int | None
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def decode_bytes(self, ids: list[int]) -> bytes: ...
    def to_config(self) -> dict[str, Any]: ...
    def save(self, directory: Path) -> None: ...


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of characters in the training text."""

    kind = "char"
    eos_id: int | None = None

    def __init__(self, chars: list[str], *, chat_template: str | None = None) -> None:
        if not chars or any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise TokenizerError("char tokenizer needs a non-empty list of single characters")
        if len(set(chars)) != len(chars):
            raise TokenizerError("char tokenizer vocabulary has duplicate characters")
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.n_vocab = len(self.chars)
        self.chat_template = _check_chat_template(chat_template)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted({c for c in text if c not in self.stoi})
            raise TokenizerError(
                f"text has {len(unknown)} character(s) outside this model's vocabulary: "
                + ", ".join(repr(c) for c in unknown[:20])
                + (" ..." if len(unknown) > 20 else "")
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[self._check(i)] for i in ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def _check(self, i: int) -> int:
        if not 0 <= i < self.n_vocab:
            raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.n_vocab})")
        return i

    def to_config(self) -> dict[str, Any]:
        return _with_chat_template({"kind": self.kind, "chars": self.chars}, self.chat_template)

    def save(self, directory: Path) -> None:
        """Nothing beside config.json: the characters live in it."""


class BPETokenizer:
    """Byte-level BPE (GPT-2's) on tiktoken, built from mergeable ranks we hold locally."""

    kind = "bpe"

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        *,
        name: str = "gpt2",
        pat_str: str = GPT2_PAT_STR,
        special_tokens: dict[str, int] | None = None,
        eos_token: str | None = GPT2_EOT,
        chat_template: str | None = None,
    ) -> None:
        special_tokens = {GPT2_EOT: 50256} if special_tokens is None else dict(special_tokens)
        self.name = name
        self.pat_str = pat_str
        self.special_tokens = special_tokens
        self.mergeable_ranks = mergeable_ranks
        self.enc = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
        )
        self.n_vocab = self.enc.n_vocab
        self.eos_token = eos_token
        self.eos_id = special_tokens.get(eos_token) if eos_token else None
        self.chat_template = _check_chat_template(chat_template)

    @property
    def bos_token(self) -> str | None:
        """GPT-2 marks where a text begins with the token that ends one: Hugging Face's GPT-2 tokenizer names
        `<|endoftext|>` as both, and chat templates read `bos_token`."""
        return self.eos_token

    def encode(self, text: str) -> list[int]:
        # special-token text in a prompt is ordinary text, never a control token
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        for i in ids:
            if not 0 <= i < self.n_vocab:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.n_vocab})")
        return self.enc.decode_bytes(ids)

    def is_special(self, i: int) -> bool:
        return i in self.special_tokens.values()

    def to_config(self) -> dict[str, Any]:
        return _with_chat_template({
            "kind": self.kind,
            "name": self.name,
            "file": BPE_FILE,
            "sha256": hashlib.sha256(_dump_ranks(self.mergeable_ranks)).hexdigest(),
            "pat_str": self.pat_str,
            "special_tokens": self.special_tokens,
            "eos_token": self.eos_token,
            "n_vocab": self.n_vocab,
        }, self.chat_template)

    def save(self, directory: Path) -> None:
        atomic_write_bytes(Path(directory) / BPE_FILE, _dump_ranks(self.mergeable_ranks))


def _check_chat_template(template: object) -> str | None:
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"a chat template must be a string (Jinja2 text), got a {type(template).__name__}")
    return template


def _with_chat_template(config: dict[str, Any], template: str | None) -> dict[str, Any]:
    return config if template is None else {**config, "chat_template": template}


def token_spans(tokenizer: Tokenizer, ids: list[int]) -> list[tuple[str, int, int]]:
    """Each token's text and [start, stop) character offsets in the decoded text. A token that holds only part of
    a character's bytes (byte-level BPE) shows U+FFFD and spans the characters that start inside it."""
    spans, pos = [], 0
    for i in ids:
        chars = sum(1 for b in tokenizer.decode_bytes([i]) if b & 0xC0 != 0x80)  # bytes that start a character
        spans.append((tokenizer.decode([i]), pos, pos + chars))
        pos += chars
    return spans


def _dump_ranks(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's `.tiktoken` format: base64(token) rank, one per line, by rank."""
    return b"".join(
        base64.b64encode(tok) + b" " + str(rank).encode() + b"\n"
        for tok, rank in sorted(ranks.items(), key=lambda x: x[1])
    )


def _load_ranks(data: bytes, source: str) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{source}: line {n} is not 'base64-token rank'") from None
    return ranks


def gpt2_tokenizer(bpe_dir: str | os.PathLike[str] | None = None) -> BPETokenizer:
    """GPT-2's BPE from a directory holding `vocab.bpe` and `encoder.json` (checked against the hashes
    tiktoken expects). Without a directory: `$FOLIO_GPT2_BPE_DIR`, else OpenAI's public URL (network)."""
    bpe_dir = bpe_dir or os.environ.get("FOLIO_GPT2_BPE_DIR")
    if bpe_dir is None:
        vocab, encoder = f"{GPT2_PUBLIC_URL}/vocab.bpe", f"{GPT2_PUBLIC_URL}/encoder.json"
    else:
        d = Path(bpe_dir)
        vocab, encoder = d / "vocab.bpe", d / "encoder.json"
        for f, want in ((vocab, GPT2_VOCAB_BPE_SHA256), (encoder, GPT2_ENCODER_JSON_SHA256)):
            if not f.is_file():
                raise TokenizerError(f"GPT-2 BPE file not found: {f} (need vocab.bpe and encoder.json)")
            got = hashlib.sha256(f.read_bytes()).hexdigest()
            if got != want:
                raise TokenizerError(f"{f} has sha256 {got}, expected GPT-2's {want}")
        vocab, encoder = str(vocab), str(encoder)
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=vocab,
            encoder_json_file=encoder,
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
            encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
        )
    except Exception as e:  # without bpe_dir: the download failed (offline, a proxy, a changed file)
        if bpe_dir is not None:
            raise
        raise TokenizerError(
            f"cannot download GPT-2's BPE files from {GPT2_PUBLIC_URL} ({type(e).__name__}); offline, pass --bpe-dir "
            "with a folder holding vocab.bpe and encoder.json, or set FOLIO_GPT2_BPE_DIR"
        ) from None
    return BPETokenizer(ranks)


def tokenizer_from_config(cfg: dict[str, Any], directory: Path) -> CharTokenizer | BPETokenizer:
    """Rebuild the tokenizer a checkpoint describes; refuses unknown kinds and damaged files."""
    if not isinstance(cfg, dict) or "kind" not in cfg:
        raise TokenizerError("tokenizer config must be an object with a 'kind' ('char' or 'bpe')")
    kind = cfg["kind"]
    if kind == "char":
        chars = cfg.get("chars")
        if not isinstance(chars, list):
            raise TokenizerError("char tokenizer config needs 'chars', a list of characters")
        return CharTokenizer(chars, chat_template=cfg.get("chat_template"))
    if kind == "bpe":
        path = Path(directory) / cfg.get("file", BPE_FILE)
        if not path.is_file():
            raise TokenizerError(f"BPE tokenizer file missing: {path}")
        data = path.read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if cfg.get("sha256") and got != cfg["sha256"]:
            raise TokenizerError(f"{path} has sha256 {got}, config.json says {cfg['sha256']}")
        tok = BPETokenizer(
            _load_ranks(data, str(path)),
            name=cfg.get("name", "gpt2"),
            pat_str=cfg.get("pat_str", GPT2_PAT_STR),
            special_tokens=cfg.get("special_tokens"),
            eos_token=cfg.get("eos_token"),
            chat_template=cfg.get("chat_template"),
        )
        if "n_vocab" in cfg and tok.n_vocab != cfg["n_vocab"]:
            raise TokenizerError(f"{path} gives {tok.n_vocab} tokens, config.json says {cfg['n_vocab']}")
        return tok
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected 'char' or 'bpe'")
