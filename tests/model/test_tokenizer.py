"""Tokenizers: the character vocabulary and GPT-2's byte-level BPE, and a BPE tokenizer saved in a checkpoint."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import BPE_FILE, BPETokenizer, CharTokenizer, TokenizerError

# --- character level -----------------------------------------------------------------------------------------


def test_char_round_trip() -> None:
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text))
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert ids[:2] == [tok.chars.index("F"), tok.chars.index("i")]
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert tok.eos_id is None


def test_char_unknown_characters_are_listed() -> None:
    tok = CharTokenizer.from_text("abc ")
    with pytest.raises(TokenizerError, match="2 character\\(s\\) outside") as e:
        tok.encode("a cab zx z")
    assert "'x'" in str(e.value) and "'z'" in str(e.value)
    assert "'a'" not in str(e.value)


def test_char_vocabulary_is_validated() -> None:
    with pytest.raises(TokenizerError, match="duplicate"):
        CharTokenizer(["a", "b", "a"])
    with pytest.raises(TokenizerError, match="single characters"):
        CharTokenizer(["a", "bc"])


def test_char_ids_outside_vocabulary_raise_on_decode() -> None:
    tok = CharTokenizer(list("abc"))
    assert tok.decode([2, 0]) == "ca"
    for bad in (3, -1):
        with pytest.raises(TokenizerError, match=f"token id {bad} is outside the vocabulary \\[0, 3\\)"):
            tok.decode([0, bad])


# --- GPT-2 BPE -----------------------------------------------------------------------------------------------


def test_bpe_is_gpt2s(gpt2_tok: BPETokenizer) -> None:
    assert gpt2_tok.n_vocab == 50257
    assert gpt2_tok.eos_id == 50256
    assert gpt2_tok.encode("Hello world") == [15496, 995]
    assert gpt2_tok.decode([15496, 995]) == "Hello world"
    # special-token text in a prompt is ordinary text, never the end-of-text token
    assert 50256 not in gpt2_tok.encode("<|endoftext|>")


@pytest.mark.parametrize("text", ["I 🙂 tokenizers 😀", "你好，世界", "naïve café €5 — “quoted”", " \n\t "])
def test_bpe_round_trip(gpt2_tok: BPETokenizer, text: str) -> None:
    ids = gpt2_tok.encode(text)
    assert gpt2_tok.decode(ids) == text
    assert gpt2_tok.decode_bytes(ids) == text.encode("utf-8")


def test_bpe_token_can_split_a_character(gpt2_tok: BPETokenizer) -> None:
    ids = gpt2_tok.encode("🙂")  # four UTF-8 bytes, two tokens
    assert len(ids) == 2
    first, second = gpt2_tok.decode_bytes(ids[:1]), gpt2_tok.decode_bytes(ids[1:])
    assert first + second == "🙂".encode()
    assert first == b"\xf0\x9f"  # half a character: no valid UTF-8 on its own
    with pytest.raises(UnicodeDecodeError):
        first.decode("utf-8")
    assert gpt2_tok.decode(ids[:1]) == "\ufffd"  # lossy text decode replaces it


def test_bpe_ids_outside_vocabulary_raise_on_decode(gpt2_tok: BPETokenizer) -> None:
    assert gpt2_tok.decode_bytes([50256]) == b"<|endoftext|>"
    for bad in (50257, 50303, -1):
        with pytest.raises(TokenizerError, match=f"token id {bad} is outside the vocabulary"):
            gpt2_tok.decode([15496, bad])


def test_bpe_survives_a_checkpoint_round_trip(gpt2_tok: BPETokenizer, tmp_path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50304, n_layer=1, n_head=1, n_embd=8))
    save_checkpoint(tmp_path, model, gpt2_tok)
    assert (tmp_path / BPE_FILE).is_file()
    loaded = load_checkpoint(tmp_path).tokenizer
    assert isinstance(loaded, BPETokenizer)
    assert loaded.n_vocab == 50257 and loaded.eos_id == 50256
    assert loaded.mergeable_ranks == gpt2_tok.mergeable_ranks
    text = "Hello world, 你好 🙂 <|endoftext|>"
    assert loaded.encode(text) == gpt2_tok.encode(text)
    assert loaded.decode(gpt2_tok.encode(text)) == text
