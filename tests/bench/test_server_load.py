"""bench/server_load.py's load generator against a real server: clients spread over several processes count every
token and request once, with one wall clock (the benchmark itself: docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlparse

import pytest

from app.testing import serving
from bench.server_load import load
from model.testing import make_char_checkpoint


@pytest.mark.slow
def test_clients_over_several_processes_count_every_token_once(tmp_path: Path) -> None:
    clients, per_client, new_tokens = 5, 2, 6
    with serving(make_char_checkpoint(tmp_path / "tiny-char"), tmp_path / "server.log") as (base, proc):
        port = urlparse(base).port
        assert port is not None
        one = asyncio.run(load(port, clients, per_client, new_tokens, True, proc.pid, processes=1))
        spread = asyncio.run(load(port, clients, per_client, new_tokens, True, proc.pid, processes=3))
    for run, processes in ((one, 1), (spread, 3)):
        assert run["client_processes"] == processes and run["failures"] == 0
        # greedy, no stop: every request streams exactly new_tokens events; the first of each is a TTFT
        assert run["tokens"] == clients * per_client * new_tokens and run["requests"] == clients * per_client
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] < run["wall_s"]
        assert run["output_tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"])
        assert run["client_cpu_s"] > 0 and run["server_cpu_s"] >= 0
