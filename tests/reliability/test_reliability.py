"""The reliability suite, reduced to CI sizes (`QUICK`): the same functions as `python -m bench.reliability`,
which runs the full sizes and writes the figures. Each check returns its figures and a list of `problems`, the
requirements that did not hold; a test asserts that list is empty, then a few figures.

Timing: the only thresholds are the issue's functional ones (slots freed within a second of a disconnect, the
process gone within the drain timeout plus a margin, slow connections closed within twice their deadline plus 3 s).
The overload's absolute figures (every 429 within 50 ms, throughput at least 90% of the plain figure) depend on the
machine; here a 429 must only come back before any admitted request of the same burst has finished generating.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.reliability import (
    bad_inputs,
    checkpoints,
    disconnects,
    faults,
    fuzz,
    load,
    overload,
    oversized,
    reload,
    shutdown,
    slow_clients,
    training,
)
from bench.reliability.harness import QUICK

pytestmark = pytest.mark.slow
SEED = 1234


def no_problems(result: dict) -> None:
    assert result["problem_count"] == 0, "\n".join(result["problems"])


def test_fuzzing_every_operation_finds_no_5xx_and_no_undocumented_answer(server: tuple[str, int]) -> None:
    result = fuzz.run(server[0], QUICK.fuzz_examples, SEED)
    no_problems(result)
    assert result["server_errors"] == 0
    generation = [op for op in result["per_operation"] if op.startswith("POST")]
    # every POST: TGI's three, OpenAI's completions, chat and responses, Anthropic's messages and count_tokens,
    # /tokenize, /detokenize, /inspect, /admin/reload, and loading and unloading LoRA adapters
    assert sorted(generation) == sorted(f"POST {p}" for p in (
        "/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions", "/v1/responses",
        "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/inspect", "/admin/reload",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter"))
    assert len(result["per_operation"]) == len(generation) + 11, sorted(result["per_operation"])
    assert all(result["per_operation"][op]["negative"] > 0 for op in generation)
    assert 200 in result["by_status"] and 422 in result["by_status"]


def test_bad_input_table_on_every_generation_route(server: tuple[str, int]) -> None:
    result = bad_inputs.run(server[0])
    no_problems(result)
    assert result["server_errors"] == 0
    assert result["cases"] == len(bad_inputs.bad_input_table()) >= 60


def test_load_every_accepted_request_completes_with_its_tokens(server: tuple[str, int]) -> None:
    base, pid = server
    result = load.run(base, pid, QUICK.load_requests, QUICK.load_clients, QUICK.load_warmup, SEED)
    no_problems(result)  # includes: RSS after the run within 10% of after the warm-up
    assert result["completed"] == QUICK.load_requests
    assert result["streamed"] > 0 and result["with_stop_strings"] > 0


def test_disconnect_storm_frees_every_slot(server: tuple[str, int]) -> None:
    result = disconnects.run(server[0], QUICK.disconnect_streams, QUICK.disconnect_wave, SEED)
    no_problems(result)  # includes: slots free within 1 s of each wave's last cut, same greedy output after
    assert sum(result["cut"].values()) == QUICK.disconnect_streams + result["whole_requests"]
    assert result["cancelled_by_server"] > 0 and result["completed_after"] == 24


def test_a_fault_in_the_model_step_fails_only_its_request(checkpoint: Path, workdir: Path,
                                                          server: tuple[str, int]) -> None:
    result = faults.run(checkpoint, workdir, server[0], QUICK.fault_good, QUICK.fault_bad, SEED)
    no_problems(result)
    assert result["faulty_failed_alone"] == QUICK.fault_bad
    assert result["good_matching_reference"] == QUICK.fault_good
    assert result["markers_without_flag_generate"]


def test_overload_refuses_the_excess_at_once(checkpoint: Path, workdir: Path) -> None:
    result = overload.run(checkpoint, workdir, QUICK.overload_batch, QUICK.overload_waiting, QUICK.overload_factor,
                          QUICK.overload_new_tokens, QUICK.overload_rounds, timing=False)
    no_problems(result)
    capacity = QUICK.overload_batch + QUICK.overload_waiting
    assert result["accepted_per_burst"] == [capacity] * QUICK.overload_rounds
    assert result["rejected"] == (QUICK.overload_factor - 1) * capacity * QUICK.overload_rounds
    # every 429 of a burst came back before the first admitted request of it had finished generating
    assert result["rejected_latency_max_ms"] < result["accepted_latency_min_ms"]
    assert result["lone_rejected_latency_p99_ms"] < result["accepted_latency_min_ms"]


def test_sigterm_drains_active_streams_and_exits_0(checkpoint: Path, workdir: Path) -> None:
    result = shutdown.run(checkpoint, workdir, QUICK.shutdown_streams, QUICK.drain_timeout, SEED)
    no_problems(result)  # includes: exit within the drain timeout + shutdown.MARGIN, each stream ends in a final event
    assert result["exit_code"] == 0
    assert sum(result["ended"].values()) == QUICK.shutdown_streams
    assert result["admitted_after_signal"] == 0


def test_slow_clients_hold_no_slot_and_are_closed_at_their_deadlines(checkpoint: Path, workdir: Path) -> None:
    result = slow_clients.run(checkpoint, workdir, QUICK.slow_batch, QUICK.slow_waiting, QUICK.slow_connections,
                              QUICK.slow_requests, QUICK.slow_timeout)
    no_problems(result)  # includes: every ordinary request 200, nothing running, queued or reserved after
    assert result["ordinary_statuses"] == {"200": QUICK.slow_requests}
    assert result["slow_connections"] > QUICK.slow_batch + QUICK.slow_waiting
    for kind, closed in result["closed"].items():
        n = closed["connections"]
        assert (closed["closed_by_server"], closed["answers"]) == (n, {"408": n}), kind


def test_oversized_work_is_refused_or_done_off_the_event_loop(server: tuple[str, int]) -> None:
    base, pid = server
    result = oversized.run(base, pid, QUICK.stop_new_tokens, QUICK.stop_batch)
    no_problems(result)  # includes: /health answered during the largest /tokenize (if it took over 0.1 s)
    tokenize = result["tokenize"]
    assert tokenize["status"] == 200 and tokenize["over_the_limit"]["status"] == 422
    assert result["many_fields"]["statuses"] == [422] * 4  # one error each, not 150,000
    assert result["stop_strings"]["stop_strings"] == 16


def test_damaged_checkpoints_are_refused_at_startup(checkpoint: Path, workdir: Path) -> None:
    result = checkpoints.run(checkpoint, workdir)
    no_problems(result)
    assert result["refused"] == len(result["cases"]) == 10


def test_trainer_killed_at_random_resumes_to_the_same_weights(workdir: Path) -> None:
    result = training.run(workdir, QUICK.training_kills, QUICK.training_iters, SEED)
    no_problems(result)  # includes: every checkpoint on disk loads after every kill
    assert result["kills"] == QUICK.training_kills + 1  # the targeted kill, then the random ones
    assert result["final_weights_bitwise_equal"] and result["best_checkpoint_bitwise_equal"]
    assert result["val_loss"] == result["reference_val_loss"]


def test_reload_under_load_serves_every_request_from_the_newest_weights(workdir: Path) -> None:
    """--watch on a directory the trainer writes to, under streaming clients: 0 failed, several checkpoints
    answered, memory level (bench/reliability/reload.py)."""
    result = reload.run(workdir, QUICK.reload_clients, QUICK.reload_iters)
    no_problems(result)
    assert result["failed"] == 0 and result["served"] > 0 and result["reloads"] >= 1
    assert result["swap_latency_s"] is not None
