"""The garbage collector's pauses in a serving process: the heap frozen at start-up (`--gc-freeze`, the default)
against the collector left as Python has it (`--no-gc-freeze`), same run.

    python -m bench.gc_pauses [--checkpoint DIR] [--clients 32] [--requests 30] [--new-tokens 64] [--rounds 6]

Two `python -m app` servers on 127.0.0.1, one each way, are driven in alternating rounds by the same load (streaming
clients of `/generate_stream`, greedy, from this process: bench/load_client.py); only one runs a load at a time.
Per round and side: output tokens/s, time to first token p99, the gap between two tokens of a stream (p99 and the
longest) as the clients see it, and the server's own record of its collections (`folio_gc_pause_seconds` from
/metrics, model/heap.py): how many of each generation, their seconds, and the longest's bucket. Prints a table,
writes gc_pauses.json and .png to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from app.http.metrics import PAUSE_LE
from app.testing import free_port, launch, metric, stop, wait_healthy
from bench import REPO, RESULTS
from bench.load_client import clients as run_clients
from bench.report import cpu_name, pct, pyplot, save_figure, write_json

SIDES = {"frozen": "--gc-freeze", "unfrozen": "--no-gc-freeze"}


def gc_record(base: str) -> dict[str, dict[str, Any]]:
    """The server's collections so far, by generation: count, seconds, and each bucket's cumulative count."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    name = "folio_gc_pause_seconds"
    return {g: {"count": metric(text, f"{name}_count", generation=g),
                "seconds": metric(text, f"{name}_sum", generation=g),
                "buckets": {le: metric(text, f"{name}_bucket", generation=g, le=le)
                            for le in PAUSE_LE}}
            for g in "012"}


def gc_delta(before: dict, after: dict) -> dict[str, dict[str, Any]]:
    """Each generation's collections between two records, with the bucket that holds the longest of them (the
    upper bound of the first bucket that all of them fit in)."""
    out = {}
    for g in after:
        count = after[g]["count"] - before[g]["count"]
        longest = next((le for le, n in after[g]["buckets"].items()
                        if n - before[g]["buckets"].get(le, 0.0) >= count), "+Inf") if count else None
        out[g] = {"count": int(count), "seconds": after[g]["seconds"] - before[g]["seconds"],
                  "longest_at_most": longest}
    return out


def one_round(base: str, port: int, clients: int, requests: int, new_tokens: int) -> dict[str, Any]:
    before = gc_record(base)
    res = asyncio.run(run_clients(port, list(range(clients)), requests, new_tokens, True))
    after = gc_record(base)
    wall = res["end"] - res["start"]
    return {"tokens_per_s": res["tokens"] / wall, "failures": res["failures"],
            "ttft_p99_ms": 1e3 * pct(res["ttft"], 0.99, float("nan")),
            "itl_p99_ms": 1e3 * pct(res["itl"], 0.99, float("nan")),
            "itl_max_ms": 1e3 * max(res["itl"], default=float("nan")), "gc": gc_delta(before, after)}


def plot(report: dict[str, Any], png: Path) -> None:
    """Per round: the longest gap between two tokens, and the seconds of full (generation 2) collections."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for side, rounds in report["rounds"].items():
        x = range(1, len(rounds) + 1)
        left.plot(x, [r["itl_max_ms"] for r in rounds], marker="o", label=side)
        right.plot(x, [1e3 * r["gc"]["2"]["seconds"] for r in rounds], marker="o", label=side)
    left.set_title("longest gap between two tokens of a stream")
    left.set_ylabel("ms")
    right.set_title("full collections (generation 2), in all")
    right.set_ylabel("ms")
    for ax in (left, right):
        ax.set_xlabel("round")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['clients']} streaming clients x {report['requests_per_client']} requests of "
                 f"{report['new_tokens']} tokens; {report['machine']['cpu']}")
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gc_pauses", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "weights" / "shakespeare-char"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=30, help="requests per client and round")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    logs = Path(tempfile.mkdtemp(prefix="folio-gc-pauses-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for side, flag in SIDES.items():
            port = free_port()
            log = logs / f"{side}.log"
            proc = launch([sys.executable, "-m", "app", "--checkpoint", args.checkpoint, "--port", str(port), flag,
                           "--log-level", "warning"], log, cwd=REPO)
            servers[side] = (proc, port)
            wait_healthy(proc, f"http://127.0.0.1:{port}", log, timeout=300)
        for _, port in servers.values():  # a warm-up round each, not counted
            asyncio.run(run_clients(port, list(range(args.clients)), 1, args.new_tokens, True))
        rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for i in range(args.rounds):
            for side, (_, port) in servers.items():
                r = one_round(f"http://127.0.0.1:{port}", port, args.clients, args.requests, args.new_tokens)
                rounds[side].append(r)
                g2 = r["gc"]["2"]
                print(f"round {i + 1} {side:<9} {r['tokens_per_s']:8.0f} tok/s  TTFT p99 {r['ttft_p99_ms']:6.1f} ms  "
                      f"ITL p99 {r['itl_p99_ms']:5.1f} max {r['itl_max_ms']:6.1f} ms  gen2 {g2['count']} "
                      f"({1e3 * g2['seconds']:.1f} ms, longest <= {g2['longest_at_most']} s)  "
                      f"gen0/1 {r['gc']['0']['count']}/{r['gc']['1']['count']} "
                      f"({1e3 * (r['gc']['0']['seconds'] + r['gc']['1']['seconds']):.1f} ms)", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    report = {"machine": {"cpu": cpu_name()}, "checkpoint": args.checkpoint, "clients": args.clients,
              "requests_per_client": args.requests, "new_tokens": args.new_tokens, "rounds": rounds}
    write_json(out / "gc_pauses.json", report)
    plot(report, out / "gc_pauses.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
