"""Training throughput and MFU on this machine: `python -m bench.train_throughput`.

First measures the machine's fp32 matmul peak (square matmuls of each `--sizes`, best of `--repeats`, torch
using `--threads` threads, all cores by default). Then, for each preset, builds the trainer on tiny
Shakespeare and times `--steps` optimizer steps (forward, backward, AdamW) after `--warmup` untimed ones,
without evaluation or checkpoints. Reports tokens/s and model FLOPs utilisation,

    MFU = tokens/s * flops_per_token(config) / measured peak,

with `flops_per_token` the trainer's 6N + 12 L T d (PaLM appendix B, as nanoGPT). Prints a table and
writes `train_throughput.json` and `train_throughput.png` (bar chart) into `--out-dir` (bench/results).

Run it on an otherwise idle machine, from the repository root:

    python -m bench.train_throughput
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS, SHARED_DATA
from bench.report import cpu_name, pyplot, save_figure, write_json
from model.train.config import PRESETS, TrainConfig
from model.train.optim import flops_per_token, get_lr
from model.train.trainer import Trainer

DEFAULT_DATA = SHARED_DATA / "tinyshakespeare" / "input.txt"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(sizes: list[int], repeats: int, device: torch.device) -> list[dict[str, float]]:
    """GFLOP/s of an (n, n) @ (n, n) fp32 matmul for each n: 2 n^3 FLOPs over the best of `repeats` runs."""
    rows = []
    for n in sizes:
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        torch.mm(a, b)  # warm up: thread pool, allocator, kernels
        sync(device)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        rows.append({"n": n, "seconds": best, "gflops": 2 * n**3 / best / 1e9})
    return rows


def train_throughput(preset: str, data: Path, steps: int, warmup: int, threads: int, device: str,
                     peak_gflops: float) -> dict[str, Any]:
    """Time `steps` training steps of `preset` after `warmup` untimed ones."""
    with tempfile.TemporaryDirectory(prefix="folio-bench-") as tmp:
        cfg = TrainConfig(**{**PRESETS[preset], "preset": preset, "data": str(data), "out": tmp,
                             "max_iters": warmup + steps, "device": device, "threads": threads, "progress": False})
        trainer = Trainer(cfg)
        trainer.model.train()
        for it in range(warmup):
            trainer.train_step(get_lr(it, cfg))
        sync(trainer.device)
        t0 = time.perf_counter()
        for it in range(warmup, warmup + steps):
            loss = trainer.train_step(get_lr(it, cfg))
        sync(trainer.device)
        elapsed = time.perf_counter() - t0
        model_config = trainer.model_config
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    tokens_per_s = steps * tokens_per_step / elapsed
    fpt = flops_per_token(model_config)
    return {
        "preset": preset,
        "params_m": model_config.num_params() / 1e6,
        "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "block_size": cfg.block_size,
        "batch_size": cfg.batch_size, "tokens_per_step": tokens_per_step,
        "steps": steps, "warmup": warmup, "seconds": elapsed,
        "ms_per_step": 1000 * elapsed / steps,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "achieved_gflops": tokens_per_s * fpt / 1e9,
        "mfu": tokens_per_s * fpt / (peak_gflops * 1e9),
        "last_loss": loss,
    }


def plot(results: dict[str, Any], png: Path) -> None:
    """Tokens/s and MFU per preset."""
    plt = pyplot()
    runs = results["runs"]
    names = [r["preset"] for r in runs]
    fig, (ax_tps, ax_mfu) = plt.subplots(1, 2, figsize=(10, 4.2))
    bars = ax_tps.bar(names, [r["tokens_per_s"] for r in runs], color="tab:blue")
    ax_tps.bar_label(bars, labels=[f"{r['tokens_per_s']:,.0f}" for r in runs])
    ax_tps.set_ylabel("training tokens / s")
    bars = ax_mfu.bar(names, [100 * r["mfu"] for r in runs], color="tab:orange")
    ax_mfu.bar_label(bars, labels=[f"{100 * r['mfu']:.1f}%" for r in runs])
    ax_mfu.set_ylabel("MFU (% of measured fp32 matmul peak)")
    for ax in (ax_tps, ax_mfu):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    m = results["machine"]
    fig.suptitle(f"{m['cpu']}, {m['threads']} threads, peak {results['peak_gflops']:.0f} GFLOP/s "
                 f"(torch {m['torch_version']})", fontsize=9)
    save_figure(fig, png)


def print_peak(rows: list[dict[str, float]], device: torch.device) -> float:
    """The matmul figures, and the peak (returned)."""
    peak = max(r["gflops"] for r in rows)
    print(f"fp32 matmul, {torch.get_num_threads()} threads on {device}:")
    for r in rows:
        print(f"  {r['n']:>5} x {r['n']:<5} {r['gflops']:10.1f} GFLOP/s")
    print(f"  peak {peak:.1f} GFLOP/s\n")
    return peak


def print_runs(runs: list[dict[str, Any]]) -> None:
    header = f"{'preset':<24}{'params':>9}{'tok/step':>10}{'ms/step':>10}{'tokens/s':>11}{'GFLOP/s':>10}{'MFU':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in runs:
        print(f"{r['preset']:<24}{r['params_m']:>8.2f}M{r['tokens_per_step']:>10}{r['ms_per_step']:>10.1f}"
              f"{r['tokens_per_s']:>11,.0f}{r['achieved_gflops']:>10.1f}{100 * r['mfu']:>7.1f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["shakespeare-char-cpu", "shakespeare-char-small"],
                   choices=sorted(PRESETS), metavar="PRESET")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="training text (default: tiny Shakespeare)")
    p.add_argument("--steps", type=int, default=30, help="timed training steps per preset")
    p.add_argument("--warmup", type=int, default=5, help="untimed training steps before the timed ones")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096], help="matmul sizes for the peak")
    p.add_argument("--repeats", type=int, default=5, help="matmuls per size; the fastest counts")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not args.data.is_file():
        print(f"error: training text not found: {args.data} (pass --data)", file=sys.stderr)
        return 2
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be at least 1 and --warmup at least 0", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak_rows = matmul_peak(args.sizes, args.repeats, device)
    peak = print_peak(peak_rows, device)

    runs = []
    for preset in args.presets:
        print(f"training {preset}: {args.warmup} warmup + {args.steps} timed steps ...", flush=True)
        runs.append(train_throughput(preset, args.data, args.steps, args.warmup, args.threads, args.device, peak))

    print_runs(runs)

    results = {
        "machine": {
            "cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "device": str(device), "torch_version": torch.__version__, "python": platform.python_version(),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "peak_gflops": peak,
        "matmul": peak_rows,
        "runs": runs,
    }
    write_json(args.out_dir / "train_throughput.json", results)
    plot(results, args.out_dir / "train_throughput.png")
    print(f"\nwrote {args.out_dir / 'train_throughput.json'} and {args.out_dir / 'train_throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
