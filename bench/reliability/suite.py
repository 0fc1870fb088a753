"""The sections in the order they run, on the servers they share: those that can use the main server (capacity
48, max_new_tokens up to 512) run against one, the others start servers (or trainers) of their own. A section
that crashes counts as failed; the others still run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.testing import serving
from bench import REPO
from bench.reliability import (
    bad_inputs,
    checkpoints,
    disconnects,
    faults,
    fuzz,
    hot_reload,
    load,
    overload,
    oversized,
    reload,
    shutdown,
    slow_clients,
    training,
)
from bench.reliability.harness import MAIN_ARGS, Sizes
from model.testing import make_char_checkpoint

SECTIONS = ("fuzz", "bad_inputs", "load", "overload", "disconnects", "shutdown", "faults", "checkpoints", "training",
            "slow_clients", "oversized", "reload", "hot_reload")
ON_THE_MAIN_SERVER = {"fuzz", "bad_inputs", "load", "disconnects", "faults", "oversized"}
BUNDLED = REPO / "weights" / "shakespeare-char"  # the hot_reload section's model: long streams of a real one
Report = Callable[[str, dict[str, Any]], None]


def _timed(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one section: its figures with `seconds`, or a crash as its one problem."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # a crashed section is a failed one; the others still run
        out = {"problems": [f"the section crashed: {type(e).__name__}: {e}"], "problem_count": 1}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["problems"] = list(out["problems"])
    return out


def _main_server_sections(ck: Path, base: str, pid: int, sizes: Sizes, workdir: Path,
                          seed: int) -> dict[str, Callable[[], dict[str, Any]]]:
    # oversized first: its memory figures are of a server that has done nothing else
    return {
        "oversized": lambda: oversized.run(base, pid, sizes.stop_new_tokens, sizes.stop_batch),
        "fuzz": lambda: fuzz.run(base, sizes.fuzz_examples, seed),
        "bad_inputs": lambda: bad_inputs.run(base),
        "load": lambda: load.run(base, pid, sizes.load_requests, sizes.load_clients, sizes.load_warmup, seed),
        "disconnects": lambda: disconnects.run(base, sizes.disconnect_streams, sizes.disconnect_wave, seed),
        "faults": lambda: faults.run(ck, workdir, base, sizes.fault_good, sizes.fault_bad, seed),
    }


def _own_server_sections(ck: Path, sizes: Sizes, workdir: Path, seed: int) -> dict[str, Callable[[], dict[str, Any]]]:
    return {
        "overload": lambda: overload.run(ck, workdir, sizes.overload_batch, sizes.overload_waiting,
                                         sizes.overload_factor, sizes.overload_new_tokens, sizes.overload_rounds),
        "shutdown": lambda: shutdown.run(ck, workdir, sizes.shutdown_streams, sizes.drain_timeout, seed),
        "slow_clients": lambda: slow_clients.run(ck, workdir, sizes.slow_batch, sizes.slow_waiting,
                                                 sizes.slow_connections, sizes.slow_requests, sizes.slow_timeout),
        "checkpoints": lambda: checkpoints.run(ck, workdir),
        "training": lambda: training.run(workdir, sizes.training_kills, sizes.training_iters, seed),
        "reload": lambda: reload.run(workdir, sizes.reload_clients, sizes.reload_iters),
        "hot_reload": lambda: hot_reload.run(BUNDLED, workdir, sizes.hot_reload_streams, sizes.hot_reload_tokens,
                                             sizes.hot_reload_new),
    }


def run_all(sizes: Sizes, workdir: Path, seed: int, only: tuple[str, ...] = SECTIONS,
            report: Report | None = None) -> dict[str, dict[str, Any]]:
    """The sections named in `only`, each reported (`report(name, figures)`) as it ends: name -> figures."""
    ck = make_char_checkpoint(workdir / "tiny-char")
    results: dict[str, dict[str, Any]] = {}

    def run_sections(sections: dict[str, Callable[[], dict[str, Any]]]) -> None:
        for name, fn in sections.items():
            if name in only:
                results[name] = _timed(fn)
                if report:
                    report(name, results[name])

    with contextlib.ExitStack() as stack:
        if ON_THE_MAIN_SERVER & set(only):
            base, proc = stack.enter_context(serving(ck, workdir / "main.log", *MAIN_ARGS))
            run_sections(_main_server_sections(ck, base, proc.pid, sizes, workdir, seed))
    run_sections(_own_server_sections(ck, sizes, workdir, seed))
    return results


HEADLINES = {
    "fuzz": lambda r: f"{r['requests']} requests, {r['server_errors']} 5xx, statuses {r['by_status']}",
    "bad_inputs": lambda r: f"{r['cases']} cases x {r['routes']} routes = {r['requests']} requests, "
                            f"{r['server_errors']} 5xx",
    "load": lambda r: f"{r['completed']}/{r['requests']} complete, {r['clients']} clients, {r['rejected_429']} "
                      f"429s retried, {r['tokens_per_s']} tok/s, RSS {r['rss_growth']:+.1%}",
    "overload": lambda r: f"{r['burst']} at once on capacity {r['capacity']}: 429 p50 "
                          f"{r['rejected_latency_p50_ms']} ms, max {r['rejected_latency_max_ms']} ms, throughput "
                          f"x{r['throughput_ratio']}",
    "disconnects": lambda r: f"{r['streams']} cut, slots freed within {r['slots_freed_max_ms']} ms",
    "shutdown": lambda r: f"{r['streams']} streams {r['ended']}, exit {r['exit_code']} after "
                          f"{r['exit_after_s']} s, admitted after signal {r['admitted_after_signal']}",
    "faults": lambda r: f"{r['faulty_failed_alone']}/{r['faulty']} faulty failed alone, "
                        f"{r['good_matching_reference']}/{r['good']} good intact",
    "checkpoints": lambda r: f"{r['refused']}/{len(r['cases'])} refused with exit code 2",
    "slow_clients": lambda r: f"{r['slow_connections']} slow connections on capacity {r['capacity']}: ordinary "
                              f"requests {r['ordinary_statuses']}, p50 {r['ordinary_latency_p50_ms']} ms; half bodies "
                              f"closed {r['closed']['half body']['closed_by_server']}/"
                              f"{r['closed']['half body']['connections']}",
    "oversized": lambda r: f"/tokenize {r['tokenize']['chars']} chars {r['tokenize']['seconds']} s, /health max "
                           f"{r['tokenize']['health_latency_max_ms']} ms, peak RSS "
                           f"{r['tokenize']['peak_rss_after_mb']} MB; 4 bodies of {r['many_fields']['fields']} "
                           f"unknown fields: /health max {r['many_fields']['health_latency_max_ms']} ms; 16 stops "
                           f"x{r['stop_strings']['alone_ratio']} "
                           f"alone, batch x{r['stop_strings']['batch_throughput_ratio']}",
    "hot_reload": lambda r: "; ".join(
        f"{name}: {x['streams_completed_on_old_weights']}/{x['streams']} streams on the old weights, "
        f"{x['new_requests']['failed']} of {x['new_requests']['sent']} new failed, swap {x['swap_latency_s']} s"
        for name, x in r["rounds"].items()) + f"; crashed {r['crashed']}",
    "training": lambda r: f"{r['kills']} SIGKILLs, final val loss {r.get('val_loss')} vs "
                          f"{r.get('reference_val_loss')}, bitwise {r.get('final_weights_bitwise_equal')}",
}


def summary_line(name: str, r: dict[str, Any]) -> str:
    """One row of the table: the section, ok or its problem count, its time and its headline figures."""
    try:
        headline = HEADLINES[name](r)
    except (KeyError, TypeError, ValueError):  # a section that crashed has no figures
        headline = "-"
    verdict = "ok" if not r["problems"] else f"{r['problem_count']} PROBLEMS"
    return f"{name:<12} {verdict:<12} {r.get('seconds', 0):>7.1f} s  {headline}"
