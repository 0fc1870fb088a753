"""Decode speed by thread count, per model: what `model.engine.runner.default_threads` picks by rule, measured.

    python -m bench.threads [--models default,gpt2-124m] [--quantize none,int8] [--threads 1,2]

Each (model, quantization, thread count) runs in a process of its own (the kernels' pool takes its size once per
process): the engine's batch 1 (128 new tokens) and 8 concurrent requests (64 new tokens each), best of
`--repeats`. The table gives each count's tokens/s as a ratio to the fastest count for that row, and which count
the rule picks; writes bench/results/threads.json and threads.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import REPO, RESULTS
from bench.engine_decode import named_checkpoint, prompts
from bench.report import pyplot, save_figure, write_json
from model.checkpoint import Checkpoint
from model.engine import Engine
from model.engine.runner import default_threads
from model.quantize import quantize
from model.sampling_params import SamplingParams


def load(name: str, kind: str) -> Checkpoint:
    ck = named_checkpoint(name)
    quantize(ck.model, kind)
    return ck


def measure(name: str, kind: str, threads: int, repeats: int) -> dict[str, float]:
    """Tokens/s of batch 1 and of 8 concurrent requests on `threads` threads (in this process)."""
    ck = load(name, kind)
    engine = Engine(ck, max_batch_size=8, threads=threads).start()
    try:
        ps = prompts(8, ck.tokenizer.n_vocab)
        engine.generate(ps[0], SamplingParams(max_new_tokens=8))  # warm

        def batch1() -> float:
            t = time.perf_counter()
            n = engine.generate(ps[0], SamplingParams(max_new_tokens=128, stop_at_eos=False)).finished.generated_tokens
            return n / (time.perf_counter() - t)

        async def concurrent() -> float:
            t = time.perf_counter()
            streams = [engine.submit(p, SamplingParams(max_new_tokens=64, stop_at_eos=False)) for p in ps]
            results = await asyncio.gather(*(s.collect() for s in streams))
            return sum(r.finished.generated_tokens for r in results) / (time.perf_counter() - t)

        return {"batch1": max(batch1() for _ in range(repeats)),
                "concurrent8": max(asyncio.run(concurrent()) for _ in range(repeats))}
    finally:
        engine.stop()


def child(name: str, kind: str, threads: int, repeats: int) -> dict[str, float]:
    """`measure` in a fresh process."""
    code = ("import json, sys; from bench.threads import measure; "
            f"print(json.dumps(measure({name!r}, {kind!r}, {threads}, {repeats})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,gpt2-124m")
    p.add_argument("--quantize", default="none,int8")
    p.add_argument("--threads", default=",".join(str(n) for n in range(1, (os.cpu_count() or 1) + 1)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")]
    report: dict[str, Any] = {"cores": os.cpu_count(), "torch": torch.__version__, "rows": []}
    print(f"{'model':<10} {'weights':<7} {'load':<13} " + " ".join(f"{f'{n} thr':>14}" for n in counts) + "  rule")
    for name in args.models.split(","):
        params = load(name, "none").model.num_params()
        for kind in args.quantize.split(","):
            got = {n: child(name, kind, n, args.repeats) for n in counts}
            rule = default_threads(params)
            report["rows"].append({"model": name, "quantize": kind, "params": params, "rule": rule, "tok_s": got})
            for load_name in ("batch1", "concurrent8"):
                best = max(got[n][load_name] for n in counts)
                cells = " ".join(f"{got[n][load_name]:8.1f} ({got[n][load_name] / best:.2f})" for n in counts)
                print(f"{name:<10} {kind:<7} {load_name:<13} {cells}  {rule}", flush=True)
    write_json(Path(args.out_dir) / "threads.json", report)
    plot(report, counts, Path(args.out_dir) / "threads.png")
    return 0


def plot(report: dict[str, Any], counts: list[int], png: Path) -> None:
    """Per row, tokens/s against the thread count, relative to the fastest; the rule's pick marked."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, load_name in zip(axes, ("batch1", "concurrent8")):
        for row in report["rows"]:
            values = [row["tok_s"][n][load_name] for n in counts]
            rel = [v / max(values) for v in values]
            (line,) = ax.plot(counts, rel, marker="o", label=f"{row['model']} {row['quantize']}")
            ax.plot([row["rule"]], [rel[counts.index(row["rule"])]], marker="*", markersize=14, color=line.get_color())
        ax.set_title(f"{load_name}: tokens/s / best (star: the rule's pick)")
        ax.set_xlabel("threads")
        ax.set_xticks(counts)
    axes[0].set_ylabel("relative to the fastest count")
    axes[0].legend(fontsize=8)
    save_figure(fig, png)


if __name__ == "__main__":
    raise SystemExit(main())
