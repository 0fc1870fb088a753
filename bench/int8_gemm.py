"""The kernels' own int8 GEMM in AMX-INT8's tiles against the same GEMM in AVX512-VNNI's `vpdpbusd`, one process,
alternated (`python -m bench.int8_gemm`): the products of one int8 GPT-2 small decode step (12 blocks' four
products and the LM head, each block's weights its own, so that a step streams 124 MB as the engine's does) at each
row count, best of `--repeats`. The ratio says from how many rows the tiles win (model/kernels/build.py's
AMX_GEMM_MIN_ROWS). Needs the avx512vnni kernels and a CPU with AMX-INT8. Prints a table; writes
bench/results/int8_gemm.json and .png.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench import RESULTS
from bench.report import cpu_name, pyplot, save_figure, write_json
from model import kernels
from model.kernels import loader
from model.quantize import quantize_rows

# GPT-2 small: each block's qkv, attention output, MLP up and down products (out, in), then the LM head
BLOCK = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
LAYERS, HEAD = 12, (50257, 768)


def step_weights(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One step's int8 weights (not inference tensors: the GEMM keeps a packed copy of each), scales and biases."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for o, i in BLOCK * LAYERS + [HEAD]:
        w, s = quantize_rows(torch.randn(o, i, generator=g) * 0.02)
        out.append((w.contiguous(), s.float().contiguous(), torch.zeros(o)))
    return out


def step_seconds(lib: Any, weights: list, xs: dict[int, torch.Tensor]) -> float:  # noqa: ANN401
    t = time.perf_counter()
    for w, s, b in weights:
        lib.linear(xs[w.size(1)], w, b, None, s)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,6,8,12,16,24,32,48,64")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--name", default="int8_gemm")
    args = p.parse_args(argv)
    if not loader.load() or loader.variant().name != "avx512vnni":
        raise SystemExit(f"needs the avx512vnni kernels: {loader.status()}")
    lib = kernels.library()
    lib.use_threads(args.threads)
    before = lib.set_amx_min_rows(1)  # the tiles at every row count, to show where they win
    if not lib.amx_gemm(64, 768):
        raise SystemExit("this CPU has no AMX-INT8 the kernels may use")
    weights = step_weights()
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'rows':>5} {'AMX ms':>8} {'vpdpbusd ms':>12} {'AMX speedup':>12}")
    with torch.no_grad():
        for rows in rows_list:
            xs = {768: torch.randn(rows, 768), 3072: torch.randn(rows, 3072)}
            best = {True: float("inf"), False: float("inf")}
            for r in range(args.repeats + 1):  # the first round warms (packs the weights)
                for amx in (True, False):
                    lib.set_amx_min_rows(1 if amx else 0)
                    t = step_seconds(lib, weights, xs)
                    if r:
                        best[amx] = min(best[amx], t)
            results.append({"rows": rows, "amx_ms": best[True] * 1e3, "vpdpbusd_ms": best[False] * 1e3,
                            "amx_speedup": best[False] / best[True]})
            e = results[-1]
            print(f"{rows:>5} {e['amx_ms']:>8.2f} {e['vpdpbusd_ms']:>12.2f} {e['amx_speedup']:>11.2f}x", flush=True)
    lib.set_amx_min_rows(before)
    report = {"machine": {"cpu": cpu_name(), "kernels": loader.status(), "threads": args.threads},
              "workload": "int8 GPT-2 small: one decode step's products (48 block products + LM head)",
              "repeats": args.repeats, "results": results}
    write_json(RESULTS / f"{args.name}.json", report)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    rs = [e["rows"] for e in results]
    ax.plot(rs, [e["amx_ms"] for e in results], marker="o", label="AMX-INT8 tiles")
    ax.plot(rs, [e["vpdpbusd_ms"] for e in results], marker="s", label="AVX512-VNNI vpdpbusd")
    ax.set_xlabel("rows (a step's tokens)")
    ax.set_ylabel("ms per step's products (best)")
    ax.set_title(f"int8 GPT-2 step products, {args.threads} threads\n{cpu_name()}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
