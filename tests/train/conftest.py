"""Fixtures for the train module's tests: a short training text and the tiny run every test starts from."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

TEXT_BYTES = 20_000


def _fallback_text(n_bytes: int) -> str:
    """Seeded pseudo-English, for machines without the data set: enough structure for the loss to fall."""
    rng = random.Random(0)
    words = "the king and queen of rome shall speak to thee my lord what say you now good night".split()
    lines = []
    while sum(len(ln) + 1 for ln in lines) < n_bytes:
        lines.append(rng.choice(["ROMEO:", "JULIET:", "KING:"]) + "\n" + " ".join(rng.choices(words, k=9)) + ".")
    return "\n".join(lines)[:n_bytes] + "\n"


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The first 20 KB of tiny Shakespeare (or generated text where it is missing), in a temp directory."""
    path = tmp_path_factory.mktemp("text") / "input.txt"
    shakespeare = data_dir / "tinyshakespeare" / "input.txt"
    if shakespeare.is_file():
        path.write_text(shakespeare.read_bytes()[:TEXT_BYTES].decode("utf-8", errors="ignore"), encoding="utf-8")
    else:
        path.write_text(_fallback_text(TEXT_BYTES), encoding="utf-8")
    return path
