"""Sampling fixtures: each way the sampler draws on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model import kernels


@pytest.fixture(params=["kernels", "torch"])
def cpu_draw(request: pytest.FixtureRequest) -> Iterator[str]:
    """The sampler's two CPU paths, each in turn: the kernels' one pass per row (csrc/sampling.cpp) and torch's
    ops (every row sorted for top-p, a cumulative sum). A skip, saying why, where the kernels cannot be loaded."""
    if request.param == "torch":
        with kernels.disabled():
            yield "torch"
        return
    if not kernels.load():
        pytest.skip(f"the CPU kernels are not loaded here: {kernels.status()}")
    yield "kernels"
