"""What `POST /inspect` costs: the answer's size and latency for a 128-token text on the bundled model and a 512-token
text on GPT-2 small's shape (random init: the sizes of attention maps depend on how peaked the weights are, so
the worst-case estimate the server's limit uses is printed beside them), against a named baseline in the same run
(`/generate` of one token for the same text: the prefill of that text), and what an inspection does to a stream
running beside it (its gaps between tokens, read by a process of its own, against the same stream alone).

    python -m bench.inspect_sizes [--repeats 2] [--threads 0] [--out bench/results/inspect_sizes.json]

Each model is served by its own `python -m app` on 127.0.0.1 (`app.testing.serving`). GPT-2's BPE files come from
`FOLIO_GPT2_BPE_DIR` or ../shared/data/gpt2-bpe; the text from ../shared/data/tinyshakespeare (or a built-in one).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from app.api.inspect.protocol import InspectRequest
from app.api.inspect.router import estimated_bytes
from app.testing import serving
from bench import REPO, RESULTS, SHARED_DATA
from bench.models import gpt2_124m
from bench.report import pct, write_json
from model.checkpoint import load_checkpoint, save_checkpoint
from model.tokenizer import Tokenizer, gpt2_tokenizer

SERVER = ["--window-shift", "0", "--max-body-bytes", "2097152", "--max-new-tokens-limit", "1024"]
FALLBACK = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 200


def text_of(tokenizer: Tokenizer, n: int) -> str:
    """A text of exactly `n` tokens from tiny Shakespeare (or a built-in one), decoded from its first n tokens."""
    path = SHARED_DATA / "tinyshakespeare" / "input.txt"
    source = path.read_text()[:20_000] if path.is_file() else FALLBACK
    text = tokenizer.decode(tokenizer.encode(source)[:n])
    assert len(tokenizer.encode(text)) == n, "the text does not tokenise back to the same length"
    return text


def timed(client: httpx.Client, route: str, body: dict[str, Any], repeats: int) -> tuple[float, int]:
    """(median seconds, bytes of the answer) of `repeats` POSTs."""
    seconds, size = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = client.post(route, json=body)
        seconds.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text[:300]
        size = len(r.content)
    return statistics.median(seconds), size


# a stream read by its own process (the arrival time of each event on the machine-wide monotonic clock), so that
# the measuring process, busy with the inspection's answer, cannot delay it
STREAM_READER = """
import json, sys, time, httpx
times = []
with httpx.stream("POST", sys.argv[1] + "/generate_stream", json=json.loads(sys.argv[2]), timeout=600,
                  trust_env=False) as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            times.append(time.monotonic())
            if len(times) == 5:
                print("started", flush=True)
print(json.dumps(times), flush=True)
"""


def stream_times(base: str, body: dict[str, Any], during: Callable[[], None] | None = None) -> list[float]:
    """The arrival time of each token event of one stream, calling `during` once the stream is under way."""
    reader = subprocess.Popen([sys.executable, "-c", STREAM_READER, base, json.dumps(body)], stdout=subprocess.PIPE,
                              text=True)
    assert reader.stdout is not None
    assert reader.stdout.readline().strip() == "started"
    if during is not None:
        during()
    times = json.loads(reader.stdout.readline())
    reader.wait(60)
    return times


def _timed_inspection(client: httpx.Client, inspect: dict[str, Any], window: list[float]) -> None:
    """POST /inspect, appending its start and end (monotonic) to `window`."""
    window.append(time.monotonic())
    r = client.post("/inspect", json=inspect)
    window.append(time.monotonic())
    assert r.status_code == 200, r.text[:300]


def beside_a_stream(base: str, client: httpx.Client, inspect: dict[str, Any], tokens: int,
                    rounds: int) -> dict[str, float]:
    """A stream's gaps between tokens alone, and while an inspection runs beside it (ms): per round the median, the
    90th percentile and the largest gap, and the median of those over `rounds` (one round's largest gap on a shared
    machine is often another process's doing)."""
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": tokens, "greedy": True}}
    alone, during, seconds = [], [], []
    for _ in range(rounds):
        times = stream_times(base, body)
        alone.append([b - a for a, b in zip(times, times[1:])])
        window: list[float] = []
        times = stream_times(base, body, functools.partial(_timed_inspection, client, inspect, window))
        t0, t1 = window
        during.append([b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1] or [float("nan")])
        seconds.append(t1 - t0)
    figures = {"inspection_s": statistics.median(seconds), "tokens_during": statistics.median(map(len, during))}
    for name, gaps in (("alone", alone), ("during", during)):
        for stat, q in (("median", 0.5), ("p90", 0.9), ("max", 1.0)):
            figures[f"{name}_{stat}_ms"] = 1e3 * statistics.median(pct(g, q) for g in gaps)
    return figures


def measure(name: str, checkpoint: Path, n_tokens: int, variants: dict[str, dict[str, Any]], repeats: int,
            log: Path, threads: int) -> list[dict[str, Any]]:
    ck = load_checkpoint(checkpoint)
    text = text_of(ck.tokenizer, n_tokens)
    rows = []
    args = [*SERVER, "--threads", str(threads)]
    with serving(checkpoint, log, *args) as (base, _), httpx.Client(base_url=base, timeout=600,
                                                                     trust_env=False) as client:
        baseline, _ = timed(client, "/generate", {"inputs": text, "parameters": {"max_new_tokens": 1}}, repeats)
        for variant, options in variants.items():
            body = {"inputs": text, **options}
            seconds, size = timed(client, "/inspect", body, repeats)
            attention, rest = estimated_bytes(n_tokens, InspectRequest(**body).to_options(), ck.config)
            rows.append({"model": name, "variant": variant, "tokens": n_tokens, "bytes": size,
                         "estimate_bytes": attention + rest, "seconds": seconds, "prefill_seconds": baseline,
                         "ratio_to_prefill": seconds / baseline})
        rows[0]["stream"] = beside_a_stream(base, client, {"inputs": text, **next(iter(variants.values()))}, 200,
                                            max(3, repeats))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<22}{'request':<26}{'tokens':>7}{'bytes':>12}{'estimate':>12}{'seconds':>9}"
          f"{'prefill s':>11}{'x prefill':>10}")
    for r in rows:
        print(f"{r['model']:<22}{r['variant']:<26}{r['tokens']:>7}{r['bytes']:>12,}{r['estimate_bytes']:>12,}"
              f"{r['seconds']:>9.3f}{r['prefill_seconds']:>11.3f}{r['ratio_to_prefill']:>10.1f}")
    for r in rows:
        if "stream" in r:
            s = r["stream"]
            print(f"{r['model']}: a greedy stream's gaps between tokens (median / p90 / max of a round, ms): alone "
                  f"{s['alone_median_ms']:.1f} / {s['alone_p90_ms']:.1f} / {s['alone_max_ms']:.1f}; during the "
                  f"default inspection ({s['inspection_s']:.2f} s, {s['tokens_during']:.0f} tokens) "
                  f"{s['during_median_ms']:.1f} / {s['during_p90_ms']:.1f} / {s['during_max_ms']:.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inspect_sizes", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="the servers' --threads (0: every core)")
    p.add_argument("--out", type=Path, default=RESULTS / "inspect_sizes.json")
    args = p.parse_args(argv)
    bpe = Path(os.environ.get("FOLIO_GPT2_BPE_DIR") or SHARED_DATA / "gpt2-bpe")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows += measure("shakespeare-char", REPO / "weights" / "shakespeare-char", 128, {
            "default (dense, all)": {},
            "one layer, no lens": {"layers": [5], "lens": False, "top_n": 0},
        }, args.repeats, work / "char.log", args.threads)
        gpt2 = save_checkpoint(work / "gpt2-small", gpt2_124m(), gpt2_tokenizer(bpe),
                               training={"note": "random init, GPT-2 small's shape"})
        rows += measure("gpt2-small (random)", gpt2, 512, {
            "default (sparse, all)": {},
            "one layer, no lens": {"layers": [11], "lens": False, "top_n": 0},
            "dense one head, no lens": {"layers": [11], "heads": [0], "dense_max_tokens": 512, "lens": False},
        }, args.repeats, work / "gpt2.log", args.threads)
    print_table(rows)
    load = os.getloadavg()
    write_json(args.out, {"rows": rows, "threads": args.threads, "machine": {
        "cores": os.cpu_count(), "load_average": load, "note": "a shared 2-core machine; other work ran beside it"}})
    print(f"wrote {args.out} (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
