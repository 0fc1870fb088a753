"""The report: the machine's CPU and SIMD flags, each server's best figures and their ratio to the best peer's,
printed as a table and drawn as bar charts."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from bench.report import pyplot, save_figure

SIMD_FLAG = re.compile(r"^(sse4_2|avx|avx2|fma|f16c|avx_vnni|avx512.*|amx.*)$")


@functools.cache  # the CPU does not change within a run: the native builds' cache key, each native server, the report
def cpu_info() -> dict[str, Any]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return {"model": f"unknown (lscpu: {e})", "flags": [], "simd_flags": []}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "?").strip(), "cpus": os.cpu_count(), "flags": flags,
            "simd_flags": [f for f in flags if SIMD_FLAG.match(f)]}


def tier(name: str, flags: list[str]) -> str:
    """The CPU tier the run measured, in words: the instruction sets Folio's kernels and torch's GEMMs used."""
    from model.kernels.build import best_variant  # the kernels' own choice (loader.py), as the servers make it

    if name == "avx2":
        held = " on a CPU with more, Folio and torch held to it" if "avx512f" in flags else ""
        return f"AVX2{held} (llama.cpp: its generic AVX2 build)"
    variant = best_variant(frozenset(flags))
    amx = " + AMX (the kernels' int8 GEMM, oneDNN's bf16 one)" if "amx_int8" in flags else ""
    return f"{variant.name if variant else 'no kernels'}{amx}"


# (key in the report, column title, higher is better)
FIGURES = [("batch1", "batch 1 tok/s", True), ("concurrent", "{c} conc. tok/s", True),
           ("ttft_fresh_ms", "fresh {p} ms", False), ("ttft_again_ms", "same again ms", False)]


def best_of(entry: dict[str, Any], key: str, higher: bool) -> float:
    values = entry[key]["tok_s"] if isinstance(entry[key], dict) else entry[key]
    return max(values) if higher else min(values)


def summarise(report: dict[str, Any]) -> None:
    """Best figures per server, and each as a ratio to the best peer's (> 1: better than every peer)."""
    ok = {n: e for n, e in report["servers"].items() if e["status"] == "ok"}
    for key, _, higher in FIGURES:
        peers = [best_of(e, key, higher) for n, e in ok.items() if not n.startswith("folio")]
        best_peer = (max(peers) if higher else min(peers)) if peers else None
        for e in ok.values():
            v = best_of(e, key, higher)
            e.setdefault("best", {})[key] = v
            e.setdefault("vs_best_peer", {})[key] = (
                (v / best_peer if higher else best_peer / v) if best_peer else None)


def print_table(report: dict[str, Any]) -> None:
    cpu = report["machine"]["cpu"]
    print(f"\nCPU: {cpu['model']} ({cpu['cpus']} cpus); SIMD flags: {' '.join(cpu['simd_flags'])}")
    print(f"tier: {report['machine']['tier']}")
    print(f"{report['threads']} threads per server; x = ratio to the best peer (> 1: better than every peer)")
    titles = [t.format(c=report["workload"]["concurrency"], p=report["workload"]["prompt_tokens"])
              for _, t, _ in FIGURES]
    print(f"{'server':<18}" + "".join(f"{t:>17} {'x':>5}" for t in titles) + f"  {'agrees (tokens)':>15}  "
          "requests short of their tokens")
    for name, e in report["servers"].items():
        if e["status"] != "ok":
            print(f"{name:<18} {e['status']}: {e['reason'].splitlines()[0][:150]}")
            continue
        row = f"{name:<18}"
        for key, _, _ in FIGURES:
            ratio = e["vs_best_peer"][key]
            row += f"{e['best'][key]:17.1f} {ratio:5.2f}" if ratio else f"{e['best'][key]:17.1f} {'-':>5}"
        a = e.get("agreement")
        if name == "folio":
            row += f"  {'reference':>15}"
        else:
            row += f"  {a['tokens']:>7} of {a['of_tokens']:<4}" if a else f"  {'-':>15}"
        early = (sum(t < e["batch1"]["wanted"] for t in e["batch1"]["tokens"])
                 + sum(r["short_requests"] for r in e["concurrent"]["rounds"]))
        print(row + f"  {'ignore_eos' if e['ignore_eos'] else 'EOS stops'}, {early} short")


def plot(report: dict[str, Any], png: Path) -> None:
    """A bar chart per figure, Folio's bars in blue."""
    plt = pyplot()
    ok = {n: e for n, e in report["servers"].items() if e["status"] == "ok"}
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.2 * len(FIGURES), 4.5))
    for ax, (key, title, higher) in zip(axes, FIGURES):
        names = list(ok)
        ax.bar(names, [ok[n]["best"][key] for n in names],
               color=["tab:blue" if n.startswith("folio") else "tab:grey" for n in names])
        ax.set_title(title.format(c=report["workload"]["concurrency"], p=report["workload"]["prompt_tokens"]) +
                     (" (higher is better)" if higher else " (lower is better)"), fontsize=9)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.suptitle(f"{report['machine']['cpu']['model']} ({report['machine']['tier']}), {report['threads']} threads"
                 " per server"
                 + (" - SMOKE RUN, not a result" if report["smoke"] else ""), fontsize=10)
    save_figure(fig, png)
