"""What choosing the next tokens costs per decode step: Folio's `Sampler` against transformers' logits warpers and
`torch.multinomial` (what `generate(do_sample=True)` runs), on GPT-2's vocabulary.

    python -m bench.sampling [--device cpu|cuda] [--rows 1,8,32] [--against REV]

One step's pass over the logits of `--rows` rows (50,304 ids, GPT-2's padded vocabulary; 50,257 usable): greedy,
temperature 1, top-k 50, top-p 0.9 (temperature 0.8), min-p 0.05, and a mix of them (the rows of one batch asking
for different things, which transformers cannot do in one call: no baseline). Each on two kinds of logits: random
rows shaped like a trained model's (a Zipf law, the k-th most likely id's logit -1.1 ln k, ids shuffled per row)
and the flat rows of a model at random init (N(0, 1)), where top-p keeps most of the vocabulary. Folio's pass is
the whole of what the engine calls (each row's own generator, log-probabilities, the copy to the host);
transformers' is its warpers, the softmax, the draw and the copy of the ids to the host; both in a process whose
malloc keeps freed memory and whose CPU kernels are loaded, as a CPU engine's are (model/malloc.py,
model/kernels/). `--against REV` adds
Folio's sampler as it was at a git revision (model/sampler.py of REV, imported beside today's), for a change to it.

Prints a table and writes bench/results/sampling.json and .png; the best of `--repeats` runs of each (and of
as many as fill MIN_SECONDS). The figures
depend on the machine (its name is in the JSON); the ratios matter.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench import REPO, RESULTS
from bench.report import cpu_name, pyplot, save_figure, write_json
from model import kernels
from model import sampler as today
from model.malloc import keep_freed_memory
from model.sampler import new_generator
from model.sampling_params import SamplingParams

VOCAB, N_VOCAB = 50304, 50257  # GPT-2's padded vocabulary and its usable ids
CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature 1": {"do_sample": True},
    "top-k 50": {"do_sample": True, "top_k": 50},
    "top-p 0.9": {"do_sample": True, "top_p": 0.9, "temperature": 0.8},
    "min-p 0.05": {"do_sample": True, "min_p": 0.05},
}
MIXED = "mixed"  # the rows cycle through the cases above


def logits_of(kind: str, rows: int, device: str) -> torch.Tensor:
    """`rows` rows of logits: "zipf" (a trained model's shape) or "flat" (random init)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "flat":
        out = torch.randn(rows, VOCAB, generator=gen)
    else:
        ranks = torch.arange(1, VOCAB + 1, dtype=torch.float64).log() * -1.1
        out = torch.stack([ranks[torch.randperm(VOCAB, generator=gen)] for _ in range(rows)]).float()
    return out.to(device)


def params_of(case: str, rows: int) -> list[SamplingParams]:
    if case == MIXED:
        cycle = list(CASES.values())
        return [SamplingParams(seed=i, **cycle[i % len(cycle)]) for i in range(rows)]
    return [SamplingParams(seed=i, **CASES[case]) for i in range(rows)]


def folio_pass(sampler_module: ModuleType, logits: torch.Tensor, params: list[SamplingParams]) -> Callable[[], Any]:
    """One step of `sampler_module`'s Sampler over `logits`, each sampled row with its own generator."""
    rows = [sampler_module.SampleRow(p, None if p.is_greedy else new_generator(p.seed))
            for p in params]
    sampler = sampler_module.Sampler(N_VOCAB)
    return lambda: sampler(logits, rows).tokens


def transformers_pass(logits: torch.Tensor, params: SamplingParams) -> Callable[[], Any]:
    """transformers' sampling step for every row alike: its warpers (temperature, top-k, top-p, min-p, the order
    `generate` applies them in), softmax, `torch.multinomial`, the ids to the host; greedy: the argmax."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list[Any] = []
    if params.temperature not in (None, 1.0):
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p not in (None, 1.0):
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    ids = torch.zeros((logits.size(0), 1), dtype=torch.long, device=logits.device)
    gen = torch.Generator(device=logits.device).manual_seed(0)

    def step() -> list[int]:
        scores = logits[:, :N_VOCAB]
        if params.is_greedy:
            return scores.argmax(-1).tolist()
        for warp in warpers:
            scores = warp(ids, scores)
        return torch.multinomial(torch.softmax(scores, -1), 1, generator=gen)[:, 0].tolist()

    return step


def sampler_at(rev: str) -> ModuleType:
    """model/sampler.py as it was at git revision `rev`, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:model/sampler.py"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"sampler_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sampler_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# a case runs at least `--repeats` times and at least this long: a fraction of a millisecond, best of 5, swung 3x
# with this VM's noise (greedy over 32 rows: 0.19 ms in a loop, 0.57 in the table)
MIN_SECONDS = 0.2


def best_ms(step: Callable[[], Any], repeats: int, device: str) -> float:
    step()  # warm up
    best, runs, began = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - began < MIN_SECONDS:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()  # every pass ends with its ids on the host
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best * 1e3


def plot(results: list[dict[str, Any]], rows: int, png: Path, title: str) -> None:
    """Milliseconds per step at `rows` rows, per case and kind of logits: Folio, transformers (and the revision)."""
    plt = pyplot()
    chosen = [r for r in results if r["rows"] == rows]
    series = [k for k in ("folio", "transformers", "against") if any(r.get(k) is not None for r in chosen)]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(series)
    for j, key in enumerate(series):
        ax.bar([i + j * width for i in range(len(chosen))], [r.get(key) or 0 for r in chosen], width,
               label={"folio": "Folio", "transformers": "transformers + multinomial",
                      "against": "Folio at the revision"}[key])
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(chosen))],
                  [f"{r['case']}\n{r['logits']}" for r in chosen], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, png)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--against", metavar="REV", help="also Folio's sampler at this git revision")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # as a CPU engine does: every pass here (and the revision's) runs with them
    keep_freed_memory()
    if args.device == "cpu":
        kernels.load()  # the sampler's passes per row: argmax and log-sum-exp, and the draw
    row_counts = [int(r) for r in args.rows.split(",")]
    against = sampler_at(args.against) if args.against else None
    results = []
    print(f"{'rows':>4}  {'case':<14} {'logits':<5} {'Folio ms':>9} {'transformers':>12} {'ratio':>6}"
          + (f" {args.against + ' ms':>12} {'ratio':>6}" if against else ""), flush=True)
    for rows in row_counts:
        for kind in ("zipf", "flat"):
            logits = logits_of(kind, rows, args.device)
            for case in [*CASES, MIXED]:
                params = params_of(case, rows)
                folio = best_ms(folio_pass(today, logits, params), args.repeats, args.device)
                hf = None if case == MIXED else best_ms(transformers_pass(logits, params[0]), args.repeats,
                                                        args.device)
                old = None if against is None else best_ms(folio_pass(against, logits, params), args.repeats,
                                                           args.device)
                results.append({"rows": rows, "case": case, "logits": kind, "folio": folio, "transformers": hf,
                                "against": old})
                line = f"{rows:>4}  {case:<14} {kind:<5} {folio:>9.3f} "
                line += f"{hf:>12.3f} {hf / folio:>5.2f}x" if hf is not None else f"{'-':>12} {'-':>6}"
                if old is not None:
                    line += f" {old:>12.3f} {old / folio:>5.2f}x"
                print(line, flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    report = {"machine": {"device": device, "cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__,
                          "kernels": kernels.status()},
              "vocab": VOCAB, "against": args.against, "results": results,
              "ratio": "transformers (or the revision) ms / Folio ms: above 1, Folio is faster"}
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    out = Path(args.out_dir)
    write_json(out / f"sampling{suffix}.json", report)
    top = max(row_counts)
    plot(results, top, out / f"sampling{suffix}.png", f"choosing {top} rows' next tokens, one step ({device}, "
         f"{args.threads} threads)")
    print(f"wrote {out / f'sampling{suffix}.json'} and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
