"""The HTTP server under load, against the engine alone and against a FastAPI + `transformers` server.

    python -m bench.server_load [--models default,gpt2-124m] [--concurrency 1,8,32,64] [--new-tokens 32]
                                [--device cpu|cuda]

For each model, a real `python -m app` process on 127.0.0.1 is driven by C concurrent streaming clients
(async httpx, `/generate_stream`, greedy; spread over `--client-processes` processes where the machine has the
cores, so that the load generator is not what limits a GPU server), each sending `--requests-per-client` requests.
Reported per C:
requests/s, output tokens/s, time to first token and inter-token latency (p50/p99), and the ratio of HTTP
throughput to engine-only throughput (the same prompts and lengths through an in-process `Engine`, same
batch limit, measured right after the server at each level). Side by side: bench/hf_server.py, a FastAPI
endpoint calling `transformers` `generate` per request on the same weights, at the concurrency levels in
`--baseline-concurrency`.

Writes bench/results/server_load.json and server_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.testing import free_port, launch, stop, wait_healthy
from bench import REPO, RESULTS, SHARED_DATA
from bench.load_client import PROMPTS
from bench.load_client import clients as run_clients
from bench.models import gpt2_124m
from bench.report import cpu_name, pct, pyplot, save_figure, write_json
from model.checkpoint import load_checkpoint, save_checkpoint
from model.engine import Engine
from model.sampling_params import SamplingParams
from model.tokenizer import gpt2_tokenizer


def start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    """`cmd` (with "{port}" replaced by a free port) running and healthy: (process, port)."""
    port = free_port()
    proc = launch([c.replace("{port}", str(port)) for c in cmd], log, cwd=REPO)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, timeout=180)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(port: int, clients: int, per_client: int, new_tokens: int, stream: bool,
               server_pid: int | None = None, processes: int = 1) -> dict:
    """`clients` streaming (or whole-body) clients, `per_client` requests each, spread over `processes` load-generator
    processes (one Python process drives a few thousand events/s, which a GPU server outruns; each further one is a
    `python -m bench.load_client`, started together once all have their connection pools): throughput, TTFT and
    ITL, and (with `server_pid`) the CPU seconds the clients and the server used meanwhile."""
    groups = [list(range(k, clients, processes)) for k in range(min(processes, clients))]
    server0 = process_cpu_s(server_pid) if server_pid else 0.0
    if len(groups) == 1:
        parts = [await run_clients(port, groups[0], per_client, new_tokens, stream)]
    else:
        parts = await _in_processes(port, groups, per_client, new_tokens, stream)
    server1 = process_cpu_s(server_pid) if server_pid else 0.0
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    ttft = [t for p in parts for t in p["ttft"]]
    itl = [t for p in parts for t in p["itl"]]
    tokens = sum(p["tokens"] for p in parts)
    n = clients * per_client
    # where the cores went: the load generator shares the machine with the server
    cpu = {"client_cpu_s": sum(p["cpu_s"] for p in parts), "server_cpu_s": server1 - server0} if server_pid else {}
    return {"clients": clients, "requests": n, "failures": sum(p["failures"] for p in parts), "wall_s": wall,
            "requests_per_s": n / wall, "output_tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 0.5, math.nan),
            "ttft_p99_s": pct(ttft, 0.99, math.nan), "itl_p50_s": pct(itl, 0.5, math.nan),
            "itl_p99_s": pct(itl, 0.99, math.nan), "tokens": tokens, "client_processes": len(groups), **cpu}


async def _in_processes(port: int, groups: list[list[int]], per_client: int, new_tokens: int,
                        stream: bool) -> list[dict[str, Any]]:
    """Each group of clients in a `bench.load_client` process of its own; all told to start at once."""
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.load_client", str(port), ",".join(map(str, ids)), str(per_client),
        str(new_tokens), "1" if stream else "0", cwd=REPO, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE) for ids in groups]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if (await asyncio.wait_for(proc.stdout.readline(), 120)).strip() != b"ready":
                raise RuntimeError(f"a load-generator process failed to start (exit {await proc.wait()})")
        for proc in procs:  # go
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        outs = [await proc.communicate() for proc in procs]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return [json.loads(out) for out, _ in outs]


class EngineAlone:
    """The same workload through an in-process engine (no HTTP), built once and kept beside the server, so that each
    concurrency level measures the server and the engine alone back to back: this machine's speed drifts by 15% over
    minutes (three rounds of GPT-2 at batch 1 on a Zen 5 gave 76, 79 and 93 tok/s), which a ratio of figures taken
    minutes apart would carry."""

    def __init__(self, checkpoint: str, max_batch: int, device: str = "cpu") -> None:
        self.checkpoint = load_checkpoint(checkpoint)
        self.engine = Engine(self.checkpoint, max_batch_size=max_batch, max_waiting=4 * max_batch,
                             device=device).start()
        self.engine.warmup()

    def measure(self, clients: int, per_client: int, new_tokens: int) -> dict[str, float]:
        """Output tokens/s of `clients` clients sending `per_client` requests each, after the same unmeasured round
        the server gets, and the CPU seconds this process used."""
        encode = self.checkpoint.tokenizer.encode

        async def client(i: int, requests: int) -> int:
            n = 0
            for r in range(requests):
                prompt = encode(PROMPTS[(i + r) % len(PROMPTS)])
                res = await self.engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens)).collect()
                n += res.finished.generated_tokens
            return n

        async def run() -> dict[str, float]:
            await asyncio.gather(*(client(i, 1) for i in range(clients)))
            cpu, t = time.process_time(), time.perf_counter()
            total = sum(await asyncio.gather(*(client(i, per_client) for i in range(clients))))
            return {"tok_s": total / (time.perf_counter() - t), "cpu_s": time.process_time() - cpu, "tokens": total}

        return asyncio.run(run())

    def stop(self) -> None:
        self.engine.stop()


def gpt2_checkpoint(directory: Path, bpe_dir: str) -> str:
    save_checkpoint(directory, gpt2_124m(), gpt2_tokenizer(bpe_dir), training={"note": "random init, for benchmarks"})
    return str(directory)


def measure_model(ck: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One checkpoint: Folio over HTTP at every concurrency level, the engine alone, and the `transformers` server."""
    levels = [int(x) for x in args.concurrency.split(",") if x]
    base_levels = [int(x) for x in args.baseline_concurrency.split(",") if x]
    entry: dict[str, Any] = {"folio": {}, "engine_tok_s": {}, "engine_cpu_ms_per_token": {},
                             "transformers_server": {}}
    alone = EngineAlone(ck, args.max_batch_size, args.device)
    server, port = start([sys.executable, "-m", "app", "--checkpoint", ck, "--port", "{port}", "--max-batch-size",
                          str(args.max_batch_size), "--max-waiting", "1024", "--log-level", "warning",
                          "--device", args.device],
                         tmp / "folio.log")
    try:
        asyncio.run(load(port, 1, 1, 8, True))  # warm the HTTP path
        for c in levels:  # the server, then the engine alone, at each level (EngineAlone says why)
            asyncio.run(load(port, c, 1, args.new_tokens, True))  # a round at this level first, not counted
            entry["folio"][str(c)] = asyncio.run(load(port, c, args.requests_per_client, args.new_tokens, True,
                                                      server.pid, args.client_processes))
            e = alone.measure(c, args.requests_per_client, args.new_tokens)
            entry["engine_tok_s"][str(c)] = e["tok_s"]
            entry["engine_cpu_ms_per_token"][str(c)] = 1e3 * e["cpu_s"] / e["tokens"]
    finally:
        stop(server, grace=30)
        alone.stop()
    if base_levels:
        base, port = start([sys.executable, "-m", "bench.hf_server", "--checkpoint", ck, "--port", "{port}",
                            "--device", args.device],
                           tmp / "hf_server.log")
        try:
            asyncio.run(load(port, 1, 1, 8, False))
            for c in base_levels:
                entry["transformers_server"][str(c)] = asyncio.run(
                    load(port, c, args.baseline_requests_per_client, args.new_tokens, False,
                         processes=args.client_processes))
        finally:
            stop(base, grace=30)
    return entry


def print_table(report: dict[str, Any]) -> None:
    """A row per model and concurrency; the ratios to the engine alone and to the `transformers` server are added
    to the report as they are printed."""
    print(f"{'model':<10} {'clients':>7} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'HTTP/engine':>11} {'x HF server':>11} {'fail':>4}   CPU ms/token: server engine client")
    for name, e in report["models"].items():
        for c, r in e["folio"].items():
            ratio = r["output_tokens_per_s"] / e["engine_tok_s"][c]
            r["http_over_engine"] = ratio
            base = e["transformers_server"].get(c)
            vs = f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:11.2f}" if base else "          -"
            if base:
                r["over_transformers_server"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
            print(f"{name:<10} {c:>7} {r['requests_per_s']:7.2f} {r['output_tokens_per_s']:8.1f} "
                  f"{r['ttft_p50_s'] * 1e3:7.0f}ms {r['ttft_p99_s'] * 1e3:7.0f}ms {r['itl_p50_s'] * 1e3:6.0f}ms "
                  f"{r['itl_p99_s'] * 1e3:6.0f}ms {ratio:11.2f} {vs} {r['failures']:4d}   "
                  f"{1e3 * r['server_cpu_s'] / r['tokens']:6.3f} {e['engine_cpu_ms_per_token'][c]:6.3f} "
                  f"{1e3 * r['client_cpu_s'] / r['tokens']:6.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server_load", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,gpt2-124m")
    p.add_argument("--checkpoint", default=str(REPO / "weights" / "shakespeare-char"))
    p.add_argument("--bpe-dir", default=str(SHARED_DATA / "gpt2-bpe"))
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--baseline-concurrency", default="32")
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--baseline-requests-per-client", type=int, default=2)  # transformers' server is slow
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu", help="where the server, the engine alone and the baseline run")
    p.add_argument("--client-processes", type=int, default=max(1, min(8, ((os.cpu_count() or 2) - 2) // 2)),
                   help="load-generator processes the clients are spread over (default: half the cores the server "
                        "leaves, at most 8; 1 on a 2-core machine)")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    report: dict = {"new_tokens": args.new_tokens, "requests_per_client": args.requests_per_client,
                    "cpu": cpu_name(), "cpu_count": os.cpu_count(), "client_processes": args.client_processes,
                    "torch": torch.__version__, "device": args.device,
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ck = args.checkpoint if name == "default" else gpt2_checkpoint(Path(tmp) / "gpt2-124m", args.bpe_dir)
            report["models"][name] = measure_model(ck, args, Path(tmp))
    print_table(report)
    write_json(Path(args.out_dir) / "server_load.json", report)
    plot(report, Path(args.out_dir) / "server_load.png")
    return 0


def plot(report: dict[str, Any], png: Path) -> None:
    """Output tokens/s against concurrency (HTTP, engine alone, the `transformers` server), and TTFT and ITL."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, e in report["models"].items():
        cs = [int(c) for c in e["folio"]]
        a1.plot(cs, [r["output_tokens_per_s"] for r in e["folio"].values()], "o-", label=f"{name}: Folio HTTP")
        a1.plot(cs, [e["engine_tok_s"][str(c)] for c in cs], "s--", label=f"{name}: engine only")
        if e["transformers_server"]:
            bc = [int(c) for c in e["transformers_server"]]
            a1.plot(bc, [r["output_tokens_per_s"] for r in e["transformers_server"].values()], "x", ms=10,
                    label=f"{name}: FastAPI + transformers")
        a2.plot(cs, [r["ttft_p50_s"] * 1e3 for r in e["folio"].values()], "o-", label=f"{name}: TTFT p50")
        a2.plot(cs, [r["itl_p50_s"] * 1e3 for r in e["folio"].values()], "s-", label=f"{name}: ITL p50")
    a1.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="output tokens/s")
    a2.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    save_figure(fig, png)


if __name__ == "__main__":
    sys.exit(main())
