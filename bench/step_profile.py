"""Where a decode step's time goes: the device's work against the host's, per model and batch size.

    python -m bench.step_profile [--device cuda] [--models default,gpt2-124m] [--batches 1,8,32] [--compile]

For each model and batch size B: B greedy requests decode `--new-tokens` tokens together through the engine (its
default path on the device: CUDA graphs on a GPU; on the CPU the same static buffers, uncaptured), and the time per
step is measured; then the step the engine last ran is replayed alone, `--replays` times (the captured graph, or on
the CPU its forward on the same buffers), with nothing else around it. The replay is the step's device work; the
rest of a step (scheduling, the inputs' copy, sampling, the wait for the token, detokenising, handing it over) is
the host's, which a GPU does not speed up. Those are a step at a time; the same engine running ahead (async
scheduling, model/engine/ahead.py) is timed too: how much of the host's work hides behind the device's. On CUDA
the number of kernels an eager step launches is counted too (torch.profiler), as a guide to what fusing would
save; and at batch 1 the engine thread is profiled (cProfile, in an engine of its own): the functions its host time
goes to, per step.

Writes bench/results/<--out-dir>/step_profile.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS
from bench.engine_decode import named_checkpoint, prompts, sync
from bench.report import pyplot, save_figure, write_json
from model.checkpoint import Checkpoint
from model.engine import Engine
from model.sampling_params import SamplingParams


def graph_engine(ck: Checkpoint, batch: int, device: str, compile: bool = False,
                 async_scheduling: bool | None = None) -> Engine:
    """An engine of `batch` rows decoding through its `DecodeGraphs` (captured on CUDA, its default; on the CPU the
    same buffers and buckets, uncaptured), running ahead as `async_scheduling` says (None: the device's default),
    not yet started."""
    engine = Engine(ck, max_batch_size=batch, max_waiting=batch, device=device, compile=compile,
                    async_scheduling=async_scheduling)
    if engine.runner.graphs is None and torch.device(device).type == "cpu":
        engine.runner.decode_through_graphs(capture=False)
    return engine


def step_ms(engine: Engine, work: list[tuple[list[int], SamplingParams]], new_tokens: int) -> float:
    """ms per step of `engine` (started) decoding `work` together, the best of two rounds after a warm-up."""
    engine.generate(work[0][0], SamplingParams(max_new_tokens=4))  # warm

    async def together() -> None:
        await asyncio.gather(*(engine.submit(p, params).collect() for p, params in work))

    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        asyncio.run(together())
        best = min(best, time.perf_counter() - t)
    return 1e3 * best / new_tokens  # the prefills' share is small against new_tokens steps


def step_times(ck: Checkpoint, batch: int, new_tokens: int, replays: int, device: str,
               compile: bool = False) -> dict[str, Any]:
    """One model and batch size: ms per engine step a step at a time, ms per replay of that step alone, and the
    host's share; then ms per step running ahead (async scheduling), where the host's work hides behind the next
    step's device work."""
    work = [(p, SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
            for p in prompts(batch, ck.tokenizer.n_vocab, seed=batch)]
    ahead = graph_engine(ck, batch, device, compile, async_scheduling=True).start()
    try:
        ahead_ms = step_ms(ahead, work, new_tokens)
    finally:
        ahead.stop()
    engine = graph_engine(ck, batch, device, compile, async_scheduling=False).start()
    runner = engine.runner
    try:
        step = step_ms(engine, work, new_tokens)
        graphs = runner.graphs
        context = max(len(p) for p, _ in work) + new_tokens
        key = graphs.bucket(batch, context) if graphs is not None else None
        out: dict[str, Any] = {"step_ms": step, "tokens_per_s": batch * 1e3 / step, "ahead_step_ms": ahead_ms,
                               "cuda_graphs": runner.cuda_graphs, "bucket": key}
        if key is not None:
            with torch.inference_mode():
                graphs.replay(key)
                sync(device)
                t = time.perf_counter()
                for _ in range(replays):
                    graphs.replay(key)
                sync(device)
            out["device_ms"] = 1e3 * (time.perf_counter() - t) / replays
            out["host_ms"] = step - out["device_ms"]
            out["host_share"] = out["host_ms"] / step
        return out
    finally:
        engine.stop()


def host_profile(ck: Checkpoint, new_tokens: int, device: str, top: int = 25) -> list[dict[str, Any]]:
    """Where the engine thread's time goes at batch 1 (cProfile on that thread alone, in an engine of its own so
    that the timed runs are not slowed): the `top` functions by their own time, in milliseconds per step."""
    engine = graph_engine(ck, 1, device)
    profiler = cProfile.Profile()
    loop = engine.scheduler.run

    def profiled() -> None:
        profiler.enable()
        try:
            loop()
        finally:
            profiler.disable()

    engine.scheduler.run = profiled  # type: ignore[method-assign]  # the thread's target, read by start()
    engine.start()
    try:
        prompt = prompts(1, ck.tokenizer.n_vocab)[0]
        engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
    finally:
        engine.stop()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
             "self_ms_per_step": 1e3 * tottime / new_tokens, "total_ms_per_step": 1e3 * cumtime / new_tokens}
            for (file, line, name), (_, calls, tottime, cumtime, _) in rows]


def eager_kernels(ck: Checkpoint, device: str) -> int | None:
    """CUDA kernels one eager batch-1 decode step launches (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(ck, max_batch_size=1, device=device, enforce_eager=True)
    try:
        runner = engine.runner
        with torch.inference_mode():
            runner.forward_chunks([0], [[1, 2, 3]], [0])
            runner.decode([0], [4], [3])
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.decode([0], [5], [4])
                sync(device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,gpt2-124m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="the engine's step compiled first (--compile; CUDA)")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "compile": args.compile,
                              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                              "new_tokens": args.new_tokens, "models": {}}
    print(f"{'model':<10} {'batch':>5} {'step ms':>8} {'device ms':>9} {'host ms':>8} {'host %':>6} {'tok/s':>9} "
          f"{'ahead ms':>8}")
    for name in args.models.split(","):
        ck = named_checkpoint(name)
        new_tokens = min(args.new_tokens, ck.config.block_size - 48)
        entry: dict[str, Any] = {"eager_step_kernels": eager_kernels(ck, args.device), "batches": {},
                                 "host_profile_batch1": host_profile(ck, new_tokens, args.device)}
        for b in [int(x) for x in args.batches.split(",") if x]:
            r = step_times(ck, b, new_tokens, args.replays, args.device, args.compile)
            entry["batches"][str(b)] = r
            print(f"{name:<10} {b:5d} {r['step_ms']:8.3f} {r.get('device_ms', float('nan')):9.3f} "
                  f"{r.get('host_ms', float('nan')):8.3f} {100 * r.get('host_share', float('nan')):5.0f}% "
                  f"{r['tokens_per_s']:9.1f} {r['ahead_step_ms']:8.3f}")
        print(f"  {name}, batch 1: the engine thread's own time per step, by function (cProfile)")
        for row in entry["host_profile_batch1"][:10]:
            print(f"  {row['self_ms_per_step']:8.4f} ms  {row['function']}")
        report["models"][name] = entry
        write_json(Path(args.out_dir) / "step_profile.json", report)
    plot(report, Path(args.out_dir) / "step_profile.png")
    return 0


def plot(report: dict[str, Any], png: Path) -> None:
    """Per model, a stacked bar per batch size: the step's device work and the host's."""
    plt = pyplot()
    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        batches = report["models"][name]["batches"]
        labels = list(batches)
        device = [batches[b].get("device_ms", 0.0) for b in labels]
        host = [batches[b].get("host_ms", 0.0) for b in labels]
        ax.bar(labels, device, label="device (the step replayed alone)")
        ax.bar(labels, host, bottom=device, label="host (the rest of a step)")
        ax.plot(labels, [batches[b]["ahead_step_ms"] for b in labels], "k_", ms=30, mew=2,
                label="a step running ahead (async scheduling)")
        ax.set(xlabel="requests decoding together", ylabel="ms per step", title=name)
        ax.legend(fontsize=8)
    where = report["gpu"] or report["device"]
    fig.suptitle(f"a decode step's time on {where}" + (" (step compiled)" if report["compile"] else ""))
    save_figure(fig, png)


if __name__ == "__main__":
    sys.exit(main())
