"""bench/step_profile.py on the CPU (its figures are a GPU's: docs/benchmarks.md): a step's time splits into the
replayed step's and the host's, and the report says so for every model and batch asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_profile import main


def test_a_step_splits_into_device_and_host_time(tmp_path: Path) -> None:
    assert main(["--models", "default", "--batches", "1,3", "--new-tokens", "8", "--replays", "5",
                 "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_profile.json").read_text())
    assert report["device"] == "cpu" and (tmp_path / "step_profile.png").stat().st_size > 0
    entry = report["models"]["default"]
    assert entry["eager_step_kernels"] is None  # counted on CUDA only
    # the engine thread's functions, by their own time per step, the largest first
    profile = entry["host_profile_batch1"]
    own = [row["self_ms_per_step"] for row in profile]
    assert len(profile) == 25 and own == sorted(own, reverse=True) and own[0] > 0
    assert all(row["calls"] > 0 and row["self_ms_per_step"] <= row["total_ms_per_step"] + 1e-9 for row in profile)
    assert any(row["function"].startswith("scheduler.py:") for row in profile)  # the loop itself
    for batch, bucket in (("1", [1, 64]), ("3", [3, 64])):  # the largest rows bucket is the batch limit itself
        r = entry["batches"][batch]
        assert r["bucket"] == bucket and r["cuda_graphs"] == "not used on this device"
        assert r["device_ms"] > 0 and r["host_ms"] == pytest.approx(r["step_ms"] - r["device_ms"])
        assert r["tokens_per_s"] == pytest.approx(int(batch) * 1e3 / r["step_ms"]) and r["ahead_step_ms"] > 0
