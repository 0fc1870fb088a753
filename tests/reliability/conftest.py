"""Fixtures for the reliability suite: the tiny character checkpoint, and one `python -m app` on 127.0.0.1 (the
bench's main server) shared by the checks that do not need a server of their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.testing import serving
from bench.reliability.harness import MAIN_ARGS
from model.testing import make_char_checkpoint


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for logs, damaged copies and training runs."""
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def checkpoint(workdir: Path) -> Path:
    return make_char_checkpoint(workdir / "tiny-char")


@pytest.fixture(scope="module")
def server(checkpoint: Path, workdir: Path) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of the main server: capacity 48 (16 running, 32 waiting), max_new_tokens up to 512."""
    with serving(checkpoint, workdir / "main.log", *MAIN_ARGS) as (base, proc):
        yield base, proc.pid
