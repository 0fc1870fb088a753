"""The HTTP server under load, against the engine alone and against a FastAPI + `transformers` server.

    python bench/server_load.py [--models default,gpt2-124m] [--concurrency 1,8,32,64] [--new-tokens 32]

For each model, a real `python -m app` process on 127.0.0.1 is driven by C concurrent streaming clients
(async httpx, `/generate_stream`, greedy), each sending `--requests-per-client` requests. Reported per C:
requests/s, output tokens/s, time to first token and inter-token latency (p50/p99), and the ratio of HTTP
throughput to engine-only throughput (the same prompts and lengths through an in-process `Engine`, same
batch limit). Side by side: bench/hf_server.py, a FastAPI endpoint calling `transformers` `generate` per
request on the same weights, at the concurrency levels in `--baseline-concurrency`.

Writes bench/results/server_load.json and server_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from model.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.engine import Engine  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.sampling_params import SamplingParams  # noqa: E402
from model.tokenizer import gpt2_tokenizer  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:\nO ", "First Citizen:\nWe are", "KING RICHARD III:\nNow is the winter",
           "HAMLET:\nTo be, or not", "MENENIUS:\nWhat", "LADY MACBETH:\nOut, damned", "BRUTUS:\nThe"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, timeout: float = 180) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(port: int, clients: int, per_client: int, new_tokens: int, stream: bool,
               server_pid: int | None = None) -> dict:
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    failures = 0

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens, failures
        for r in range(per_client):
            body = {"inputs": PROMPTS[(i + r) % len(PROMPTS)],
                    "parameters": {"max_new_tokens": new_tokens, "details": not stream}}
            t0 = time.perf_counter()
            try:
                if not stream:
                    resp = await http.post("/generate", json=body)
                    resp.raise_for_status()
                    tokens += new_tokens
                    continue
                last = None
                async with http.stream("POST", "/generate_stream", json=body) as resp:
                    resp.raise_for_status()
                    # count events in raw chunks (no per-line decoding: the client shares the server's CPUs,
                    # so a costly client would be measured as server time); events that arrive in one chunk
                    # arrived together
                    async for chunk in resp.aiter_raw():
                        now = time.perf_counter()
                        for _ in range(chunk.count(b"data:")):
                            if last is None:
                                ttft.append(now - t0)
                            else:
                                itl.append(now - last)
                            last = now
                            tokens += 1
            except httpx.HTTPError:
                failures += 1

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
        cpu0, server0 = time.process_time(), process_cpu_s(server_pid) if server_pid else 0.0
        t = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - t
        cpu1, server1 = time.process_time(), process_cpu_s(server_pid) if server_pid else 0.0
    n = clients * per_client
    # where the two cores went: the load generator shares them with the server
    cpu = {"client_cpu_s": cpu1 - cpu0, "server_cpu_s": server1 - server0} if server_pid else {}
    return {"clients": clients, "requests": n, "failures": failures, "wall_s": wall, "requests_per_s": n / wall,
            "output_tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99), "tokens": tokens, **cpu}


def engine_only(checkpoint: str, clients: int, per_client: int, new_tokens: int, max_batch: int) -> dict:
    """Output tokens/s of the same workload through an in-process engine (no HTTP), and the CPU it used."""
    ck = load_checkpoint(checkpoint)
    engine = Engine(ck, max_batch_size=max_batch, max_waiting=4 * max_batch).start()
    engine.warmup()

    async def run() -> float:
        async def client(i: int, requests: int) -> int:
            n = 0
            for r in range(requests):
                prompt = ck.tokenizer.encode(PROMPTS[(i + r) % len(PROMPTS)])
                res = await engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens)).collect()
                n += res.finished.generated_tokens
            return n

        await asyncio.gather(*(client(i, 1) for i in range(clients)))  # the same warm-up round as the server's
        cpu, t = time.process_time(), time.perf_counter()
        total = sum(await asyncio.gather(*(client(i, per_client) for i in range(clients))))
        return {"tok_s": total / (time.perf_counter() - t), "cpu_s": time.process_time() - cpu, "tokens": total}

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def gpt2_checkpoint(directory: Path, bpe_dir: str) -> str:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=True)
    save_checkpoint(directory, GPT(cfg), gpt2_tokenizer(bpe_dir), training={"note": "random init, for benchmarks"})
    return str(directory)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,gpt2-124m")
    p.add_argument("--checkpoint", default=str(REPO / "weights" / "shakespeare-char"))
    p.add_argument("--bpe-dir", default=str(REPO.parent / "shared" / "data" / "gpt2-bpe"))
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--baseline-concurrency", default="32")
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--baseline-requests-per-client", type=int, default=2)  # transformers' server is slow
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    base_levels = [int(x) for x in args.baseline_concurrency.split(",") if x]
    report: dict = {"new_tokens": args.new_tokens, "requests_per_client": args.requests_per_client,
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ck = args.checkpoint if name == "default" else gpt2_checkpoint(Path(tmp) / "gpt2-124m", args.bpe_dir)
            port = free_port()
            server = start([sys.executable, "-m", "app", "--checkpoint", ck, "--port", str(port),
                            "--max-batch-size", str(args.max_batch_size), "--max-waiting", "1024",
                            "--log-level", "warning"], port)
            entry: dict = {"folio": {}, "engine_tok_s": {}, "transformers_server": {}}
            try:
                asyncio.run(load(port, 1, 1, 8, True))  # warm the HTTP path
                for c in levels:
                    asyncio.run(load(port, c, 1, args.new_tokens, True))  # a round at this level first, not counted
                    entry["folio"][str(c)] = asyncio.run(load(port, c, args.requests_per_client, args.new_tokens, True,
                                                              server.pid))
            finally:
                stop(server)
            for c in levels:
                e = engine_only(ck, c, args.requests_per_client, args.new_tokens, args.max_batch_size)
                entry["engine_tok_s"][str(c)] = e["tok_s"]
                entry.setdefault("engine_cpu_ms_per_token", {})[str(c)] = 1e3 * e["cpu_s"] / e["tokens"]
            if base_levels:
                port = free_port()
                base = start([sys.executable, str(REPO / "bench" / "hf_server.py"), "--checkpoint", ck,
                              "--port", str(port)], port)
                try:
                    asyncio.run(load(port, 1, 1, 8, False))
                    for c in base_levels:
                        entry["transformers_server"][str(c)] = asyncio.run(
                            load(port, c, args.baseline_requests_per_client, args.new_tokens, False))
                finally:
                    stop(base)
            report["models"][name] = entry
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
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_load.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "server_load.png")
    return 0


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
