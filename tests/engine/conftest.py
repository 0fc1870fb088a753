"""Engine fixtures: a tiny seeded random GPT behind a character tokenizer, and engines that are always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from model.checkpoint import Checkpoint
from model.config import GPTConfig
from model.engine import Engine
from model.gpt import GPT
from model.tokenizer import CharTokenizer

# 65 characters: letters, punctuation and CJK, so that text is not all ASCII
CHARS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" .,;!?\n") + [chr(0x4E00 + i) for i in range(32)]
N_VOCAB = len(CHARS)
VOCAB_SIZE = 72  # padded past the tokenizer, like GPT-2's 50257 -> 50304: ids 65..71 must never come out


def tiny_checkpoint(block_size: int = 32, *, seed: int = 1, eos_id: int | None = None) -> Checkpoint:
    """A random GPT, the same weights for the same arguments.

    Weights are scaled up from GPT-2's init so that logits are spread out (near ties would make greedy parity
    depend on the last bit), and the padded rows of the tied LM head are scaled further so that a padded id is
    the largest logit nearly every step: only masking keeps them out.
    """
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=VOCAB_SIZE, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
        model.lm_head.weight[N_VOCAB:] *= 4.0
    tokenizer = CharTokenizer(CHARS)
    tokenizer.eos_id = eos_id  # a character that doubles as end-of-text, for EOS tests
    return Checkpoint(path=None, config=config, tokenizer=tokenizer, model=model)  # type: ignore[arg-type]


@pytest.fixture
def make_checkpoint() -> Callable[..., Checkpoint]:
    """Factory: `make_checkpoint(block_size=32, seed=1, eos_id=None)`."""
    return tiny_checkpoint


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Factory: `make_engine(checkpoint=None, start=True, **engine_kwargs)`; every engine is stopped afterwards."""
    engines: list[Engine] = []

    def make(checkpoint: Checkpoint | None = None, *, start: bool = True, **kwargs) -> Engine:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("threads", 1)
        engine = Engine(checkpoint or tiny_checkpoint(), **kwargs)
        engines.append(engine)
        return engine.start() if start else engine

    yield make
    for engine in engines:
        engine.fault_hook = None
        engine.stop(timeout=10)
