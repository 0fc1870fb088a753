"""The API tests' apps, shared by the package as one module shared them before: a factory of started apps (all
shut down at the end), the char-checkpoint app, the BPE-checkpoint app, and the naive reference loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from model.checkpoint import load_checkpoint
from model.reference import generate_naive
from model.sampling_params import SamplingParams
from tests.app.api.calls import BASE


@pytest.fixture(scope="package")
def make_client(char_checkpoint: Path) -> Iterator[Callable[..., TestClient]]:
    """Factory: a started app (lifespan run) for the char checkpoint or another; all shut down at the end."""
    with ExitStack() as stack:
        def make(checkpoint: Path | None = None, **overrides: Any) -> TestClient:
            settings = Settings(checkpoint=checkpoint or char_checkpoint, **{**BASE, **overrides})
            return stack.enter_context(TestClient(create_app(settings)))

        yield make


@pytest.fixture(scope="package")
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture(scope="package")
def reference(char_checkpoint: Path) -> Callable[..., tuple[list[int], str]]:
    """The naive reference loop on the same checkpoint: (token ids, decoded text)."""
    ck = load_checkpoint(char_checkpoint)

    def run(prompt: str, max_new_tokens: int, **params: Any) -> tuple[list[int], str]:
        p = SamplingParams(max_new_tokens=max_new_tokens, **params)
        ids = [t for t, _ in generate_naive(ck.model, ck.tokenizer.encode(prompt), p, n_vocab=ck.tokenizer.n_vocab)]
        return ids, ck.tokenizer.decode(ids)

    return run


@pytest.fixture(scope="package")
def bpe_client(make_client: Callable[..., TestClient], bpe_checkpoint: Path) -> TestClient:
    return make_client(bpe_checkpoint)
