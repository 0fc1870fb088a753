"""Engine fixtures: the tiny seeded random GPT behind a character tokenizer (model.testing's `tiny_checkpoint`), and
engines that are always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from model.checkpoint import Checkpoint
from model.engine import Engine
from model.testing import tiny_checkpoint


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
