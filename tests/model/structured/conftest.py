"""Structured-output fixtures: a small random GPT over GPT-2's BPE (its 50,304-id vocabulary, EOS 50256) in memory,
the bundled character model's tokenizer, and a fresh compiler per test (its compile count starts at 0)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model.checkpoint import Checkpoint, read_config
from model.config import GPTConfig
from model.structured import ConstraintCompiler
from model.testing import random_gpt
from model.tokenizer import BPETokenizer, CharTokenizer, tokenizer_from_config
from tests import REPO


@pytest.fixture(scope="session")
def bpe_checkpoint(gpt2_tok: BPETokenizer) -> Checkpoint:
    """A random 2-layer GPT with GPT-2's vocabulary, its logits spread out (scale 4) so that sampling at
    temperature 1 wanders over many tokens."""
    config = GPTConfig(block_size=128, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
    return Checkpoint(path=None, config=config, tokenizer=gpt2_tok,  # type: ignore[arg-type]
                      model=random_gpt(config, seed=0, scale=4.0))


@pytest.fixture(scope="session")
def bundled_char_tokenizer() -> CharTokenizer:
    """The bundled Shakespeare model's 65 characters: no braces, brackets or double quotes."""
    directory = REPO / "weights" / "shakespeare-char"
    tok = tokenizer_from_config(read_config(directory)["tokenizer"], directory)
    assert isinstance(tok, CharTokenizer)
    return tok


@pytest.fixture
def compiler() -> Iterator[ConstraintCompiler]:
    yield ConstraintCompiler()
