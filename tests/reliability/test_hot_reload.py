"""The hot-reload-under-load section at CI sizes (bench/reliability/hot_reload.py): the bundled model's weights
replaced atomically and by a plain `cp` while long streams run and new requests arrive."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.reliability import hot_reload
from bench.reliability.harness import QUICK
from bench.reliability.suite import BUNDLED

pytestmark = pytest.mark.slow


def test_weights_replaced_under_long_streams_lose_no_request(workdir: Path) -> None:
    result = hot_reload.run(BUNDLED, workdir, QUICK.hot_reload_streams, QUICK.hot_reload_tokens, QUICK.hot_reload_new)
    assert result["problem_count"] == 0, "\n".join(result["problems"])
    assert result["crashed"] == 0 and result["failed"] == 0 and result["reloads"] == 2
    for name in ("atomic", "plain_cp"):
        r = result["rounds"][name]
        assert r["streams_completed_on_old_weights"] == QUICK.hot_reload_streams, (name, r)
        assert r["new_requests"]["sent"] == QUICK.hot_reload_new and r["swap_latency_s"] is not None
        after = r["new_requests"]["sent_after_swap"]
        assert after >= QUICK.hot_reload_new // 2 and r["new_requests"]["sent_after_swap_on_new_weights"] == after
