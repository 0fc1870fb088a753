"""What structured output costs: decode tokens/s with a constraint against the same requests unconstrained, in the
same run, and the compile time of a 20-field JSON schema.

    python -m bench.structured [--models default,gpt2-124m] [--tokens 64] [--batch 32] [--repeats 2]

- GPT-2 124M's shape at random init (bench/models.py) over GPT-2's BPE: a 20-field JSON schema (strings of at
  most 24 characters, integers, numbers, booleans, enums, an array); the bundled character model: its vocabulary
  has no braces, so a JSON schema is refused there (the table says so) and it runs a regex of the records it can
  spell instead (`Name: words` lines).
- Batch 1 (one request at a time) and `--batch` concurrent requests, each sampled at temperature 1 (seeded, the
  same seeds both ways), up to `--tokens` new tokens; tokens/s is the tokens generated over the wall time, best of
  `--repeats`, the two variants alternating. A constrained request may end before `--tokens` (its grammar
  complete): tokens/s counts what was generated.
- The constraint's own cost per decode step (`mask_overhead_ms`: the masks, applying them, advancing the matchers)
  replayed apart from the model, and the ratio it implies against a free step (the step time from the free run):
  the wall-clock ratio is noisy on a shared machine, this one is not.
- Compile: the schema compiled by a fresh compiler (llguidance's tokenizer already built: it is built once per
  tokenizer, its time reported apart), and the same schema again (the cache).

Writes bench/results/structured.json and structured.png; prints the table and the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench import REPO, RESULTS, SHARED_DATA
from bench.models import gpt2_124m
from bench.quantize import cpu_name
from bench.report import pyplot, save_figure, write_json
from model.checkpoint import Checkpoint, load_checkpoint
from model.engine import Engine
from model.kernels.ops import fill_disallowed
from model.sampling_params import SamplingParams
from model.structured import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
    RowMatcher,
    allowed_tokens,
    ll_tokenizer,
)
from model.tokenizer import gpt2_tokenizer

BUNDLED = REPO / "weights" / "shakespeare-char"
RECORDS = r"([A-Z][a-z]{2,9}: [a-z]{2,9}( [a-z]{2,9}){0,6}[.!?]\n){1,12}"


def schema_of(fields: int = 20) -> dict[str, Any]:
    """A JSON schema of `fields` required fields, cycling through strings, integers, numbers, booleans, enums and
    arrays of enums."""
    kinds = [{"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "number", "minimum": -100, "maximum": 100}, {"type": "boolean"},
             {"enum": ["red", "green", "blue", "amber"]},
             {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def checkpoint(name: str) -> Checkpoint:
    if name == "default":
        return load_checkpoint(BUNDLED)
    model = gpt2_124m().eval()
    tok = gpt2_tokenizer(SHARED_DATA / "gpt2-bpe")
    return Checkpoint(path=Path("gpt2-124m-random"), config=model.config, tokenizer=tok, model=model)  # type: ignore


def run(engine: Engine, prompt: list[int], n: int, tokens: int, constraint: Any) -> tuple[float, int]:
    """`n` concurrent requests (seeds 0..n-1): tokens/s and the tokens generated."""
    params = [SamplingParams(max_new_tokens=tokens, temperature=1.0, do_sample=True, seed=s, stop_at_eos=False,
                             constraint=constraint) for s in range(n)]

    async def main() -> int:
        streams = [engine.submit(prompt, p) for p in params]
        results = await asyncio.gather(*(s.collect() for s in streams))
        return sum(r.finished.generated_tokens for r in results)

    t = time.perf_counter()
    generated = asyncio.run(main())
    return generated / (time.perf_counter() - t), generated


def mask_overhead_ms(engine: Engine, prompt: list[int], n: int, constraint: Any, tokens: int) -> float:
    """The constraint's own work per decode step of `n` rows, replayed apart from the model (so that other load on
    the machine does not swamp it): every row's mask, applied to a copy of their logits together (as the sampler
    applies them), and each matcher advanced, along a constrained output the engine generated."""
    ids = engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=1.0, do_sample=True, seed=0,
                                                 constraint=constraint)).token_ids
    rows = [RowMatcher(constraint) for _ in range(n)]
    logits = torch.randn(n, engine.model_config.vocab_size)
    best = float("inf")
    for _ in range(3):
        for r in rows:
            r.matcher.reset()
        t = time.perf_counter()
        for token in ids[:-1]:
            masks = allowed_tokens(rows, logits.size(1))
            fill_disallowed(logits.clone(), list(range(n)), masks)  # as the sampler applies them, to its copy
            for r in rows:
                r.advance(token)
        best = min(best, (time.perf_counter() - t) / max(1, len(ids) - 1))
    return best * 1000


def measure(name: str, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    ck = checkpoint(name)
    tok = ck.tokenizer
    compiler = ConstraintCompiler()
    t = time.perf_counter()
    ll_tokenizer(tok)
    out: dict[str, Any] = {"model": name, "tokenizer_build_s": time.perf_counter() - t}
    spec = ConstraintSpec.json_schema(schema_of())
    try:
        t = time.perf_counter()
        constraint = compiler.compile(spec, tok)
        out["compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        compiler.compile(ConstraintSpec.json_schema(schema_of()), tok)
        out["cached_compile_s"] = time.perf_counter() - t
        out["constraint"] = "20-field JSON schema"
    except ConstraintError as e:
        out["json_schema_refused"] = str(e)
        constraint = compiler.compile(ConstraintSpec.regex(RECORDS), tok)
        out["constraint"] = "regex of records"
    prompt = tok.encode("ROMEO:\n" if name == "default" else "Here is the record as JSON:\n")
    engine = Engine(ck, max_batch_size=batch, max_waiting=0).start()
    try:
        run(engine, prompt, 2, 8, constraint)  # warm both paths
        run(engine, prompt, 2, 8, None)
        for label, n in (("batch1", 1), (f"concurrent{batch}", batch)):
            best = {"free": (0.0, 0), "constrained": (0.0, 0)}
            for _ in range(repeats):
                for variant, c in (("free", None), ("constrained", constraint)):
                    got = run(engine, prompt, n, tokens, c)
                    best[variant] = max(best[variant], got)
            step_ms = 1000 * n / best["free"][0]  # a free decode step of n rows
            mask_ms = mask_overhead_ms(engine, prompt, n, constraint, tokens)
            out[label] = {"free_tok_s": best["free"][0], "constrained_tok_s": best["constrained"][0],
                          "constrained_tokens": best["constrained"][1], "free_tokens": best["free"][1],
                          "ratio": best["constrained"][0] / best["free"][0], "free_step_ms": step_ms,
                          "mask_ms_per_step": mask_ms, "ratio_from_mask_cost": step_ms / (step_ms + mask_ms)}
        out["threads"] = engine.config.threads
    finally:
        engine.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,gpt2-124m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count(), "tokens": args.tokens,
                              "batch": args.batch, "repeats": args.repeats, "models": []}
    print(f"CPU: {report['cpu']} ({report['cores']} cores)")
    print(f"{'model':<12} {'constraint':<22} {'requests':>12} {'free tok/s':>11} {'constrained':>12} {'ratio':>6} "
          f"{'step ms':>8} {'mask ms':>8} {'ratio by cost':>13}")
    for name in args.models.split(","):
        row = measure(name, args.batch, args.tokens, args.repeats)
        report["models"].append(row)
        for label in ("batch1", f"concurrent{args.batch}"):
            r = row[label]
            print(f"{name:<12} {row['constraint']:<22} {label:>12} {r['free_tok_s']:>11.1f} "
                  f"{r['constrained_tok_s']:>12.1f} {r['ratio']:>6.1%} {r['free_step_ms']:>8.2f} "
                  f"{r['mask_ms_per_step']:>8.3f} {r['ratio_from_mask_cost']:>13.1%}")
        if "compile_s" in row:
            print(f"{name:<12} compile of the 20-field schema {row['compile_s'] * 1000:.1f} ms, again (cached) "
                  f"{row['cached_compile_s'] * 1000:.3f} ms; llguidance's tokenizer built once in "
                  f"{row['tokenizer_build_s'] * 1000:.0f} ms")
        else:
            print(f"{name:<12} JSON schema refused: {row['json_schema_refused']}")
    out = Path(args.out_dir)
    write_json(out / "structured.json", report)
    plot(report, out / "structured.png")
    print(json.dumps({m["model"]: {k: m[k]["ratio"] for k in m if k.startswith(("batch1", "concurrent"))}
                      for m in report["models"]}))
    return 0


def plot(report: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels, ratios = [], []
    for m in report["models"]:
        for key in ("batch1", f"concurrent{report['batch']}"):
            labels.append(f"{m['model']}\n{key}\n({m['constraint']})")
            ratios.append(100 * m[key]["ratio"])
    bars = ax.bar(range(len(ratios)), ratios, color="#4c72b0")
    ax.bar_label(bars, fmt="%.0f%%")
    ax.axhline(90, color="#c44e52", linestyle="--", linewidth=1, label="target: 90%")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("constrained tokens/s, % of free")
    ax.set_ylim(0, max(110, max(ratios) + 10))
    ax.set_title(f"Structured output's cost ({report['cpu']})", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, png)


if __name__ == "__main__":
    raise SystemExit(main())
