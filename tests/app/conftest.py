"""App fixtures: the test checkpoints in temporary directories, and one `python -m app` server process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.testing import serving
from model.testing import make_bpe_checkpoint, make_char_checkpoint
from model.tokenizer import BPETokenizer


@pytest.fixture(scope="session")
def char_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny character-level checkpoint (session-wide; treat as read-only)."""
    return make_char_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-char")


@pytest.fixture(scope="session")
def bpe_checkpoint(tmp_path_factory: pytest.TempPathFactory, gpt2_tok: BPETokenizer) -> Path:
    """Directory of the hand-wired BPE checkpoint (skipped where GPT-2's BPE files are absent)."""
    return make_bpe_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bpe", gpt2_tok)


@pytest.fixture(scope="session")
def server(char_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of one `python -m app` on 127.0.0.1 serving the char checkpoint, started once per session."""
    with serving(char_checkpoint, tmp_path_factory.mktemp("server") / "server.log") as (base, _):
        yield base
