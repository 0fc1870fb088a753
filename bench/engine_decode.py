"""Engine-only decode speed against Hugging Face `transformers` and the naive no-cache loop, same run.

    python -m bench.engine_decode [--models default,gpt2-124m] [--new-tokens 128] [--concurrency 8,32]

For each model (the bundled default and a random-init GPT-2 124M shape):
- batch 1, greedy: Folio's engine vs `transformers` `generate` (KV cache on, same weights) vs the naive
  loop (full forward every step, nanoGPT's `generate`), plus the memory-bandwidth ceiling: the tokens/s a
  decoder reaches if every step only reads the weights once at this machine's measured read bandwidth;
- N concurrent requests of different lengths: aggregate tokens/s of the engine (continuous batching) vs
  `transformers`' static batched `generate` (left-padded prompts, run to the longest request; only the
  tokens each request asked for count), in `--repeats` alternating rounds, the best of each side.
- the same with every request sampled (`--sampled-concurrency`; temperature 1 over the whole vocabulary on both
  sides, each Folio request with its own seed): what choosing tokens by sampling costs each;
- at batch 1 and the largest concurrency, the engine again with async scheduling the other way than the device's
  default ("async off" on CUDA, "async on" on a CPU; model/engine/ahead.py): what running ahead is worth there.

Prints a table, writes bench/results/engine_decode.json and engine_decode.png. Ratios are what matter:
absolute figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import REPO, RESULTS
from bench.models import gpt2_124m, to_hf
from bench.report import cpu_name, pyplot, save_figure, write_json
from model.checkpoint import Checkpoint, load_checkpoint
from model.devices import default_dtype
from model.engine import Engine, ahead
from model.reference import generate_naive
from model.sampling_params import SamplingParams
from model.tokenizer import CharTokenizer

COMPILED_WARMUPS = 3  # generations before transformers' compiled runs are timed (compile, record, replay)


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a timer reads finished work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_read_bandwidth(gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s for reading a large fp32 tensor once (a sum), best of `repeats`."""
    x = torch.ones(int(gib * 2**30 / 4), device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def gpt2_124m_checkpoint() -> Checkpoint:
    model = gpt2_124m().eval()
    cfg = model.config
    # ids only: the text is not used, but the engine decodes it, so no surrogate code points
    tok = CharTokenizer([chr(c) for c in range(0x4E00, 0x4E00 + cfg.vocab_size + 2048) if not 0xD800 <= c < 0xE000][
        : cfg.vocab_size])
    return Checkpoint(path=Path("gpt2-124m-random"), config=cfg, tokenizer=tok, model=model)


def named_checkpoint(name: str, bundled: str | Path = REPO / "weights" / "shakespeare-char") -> Checkpoint:
    """A benchmark's model by name: "default" loads `bundled`, "gpt2-124m" is GPT-2 small's shape at random init."""
    return load_checkpoint(bundled) if name == "default" else gpt2_124m_checkpoint()


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 48, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


def compiled_static(hf: Any) -> Any:
    """`hf` with transformers' static KV cache and its decode steps under `torch.compile` (mode reduce-overhead:
    CUDA graphs on a GPU): gpt-fast's recipe as transformers documents it, the fastest way it decodes. transformers
    5 compiles the decode steps itself once the cache is static (`generate`'s auto-compile; compiling `forward` as
    well made its graphs' outputs be read after they were overwritten, on an H200 with 5.17); earlier versions are
    given the compiled forward. A copy: `hf` keeps its eager forward."""
    fast = copy.deepcopy(hf)
    fast.generation_config.cache_implementation = "static"
    if not hasattr(fast, "get_compiled_call"):
        fast.forward = torch.compile(fast.forward, mode="reduce-overhead", fullgraph=True)
    return fast


def time_compiled_static(hf: Any, ids: torch.Tensor, new_tokens: int, best: Callable[[Callable[[], None]], float],
                         device: str, folio_ids: list[int]) -> dict[str, Any]:
    """transformers' static cache under torch.compile (`compiled_static`) at batch 1: its tokens/s (`best` of its
    timed runs, after COMPILED_WARMUPS untimed ones), whether its tokens are the engine's, or the error that stopped
    it (a transformers version whose GPT-2 has no static cache, a compile that fails): the other figures stand."""
    try:
        fast = compiled_static(hf)
        t = time.perf_counter()
        for _ in range(COMPILED_WARMUPS):  # compiles (prefill and decode shapes), then records its graphs
            fast.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(device)
        warmup = time.perf_counter() - t
        tokens: list[int] = []

        def run() -> None:
            tokens[:] = fast.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[
                0, ids.shape[1]:].tolist()

        tok_s = best(run)
    except Exception as e:
        print(f"transformers' static cache under torch.compile failed: {e!r}", file=sys.stderr)
        return {"transformers_compiled_error": repr(e)[:500]}
    return {"transformers_compiled": tok_s, "transformers_compiled_warmup_s": warmup,
            "same_tokens_as_transformers_compiled": float(folio_ids == tokens)}


def bench_batch1(ck: Checkpoint, hf, new_tokens: int, repeats: int,  # noqa: ANN001
                 baseline_threads: int, device: str = "cpu", compiled: bool = False,
                 engine_compile: bool = False) -> dict[str, Any]:
    """Batch-1 greedy tokens/s: the engine (with `engine_compile` also its step compiled, `--compile`),
    transformers' `generate`, with `compiled` also transformers' static cache under torch.compile
    (`compiled_static`), and the naive loop."""
    prompt = prompts(1, ck.tokenizer.n_vocab)[0]
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    out: dict[str, Any] = {}

    def best(fn) -> float:  # noqa: ANN001
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return new_tokens / min(times)

    def time_engine(name: str, **config: Any) -> list[int]:
        """out[name]: the engine's tokens/s (built with `config`, warmed); out[name + "_start_s"]: building and
        warming it (captures, compiles); out[name + "_cuda_graphs"]: its graphs, or why none. Its tokens."""
        t = time.perf_counter()
        engine = Engine(ck, max_batch_size=1, max_waiting=0, device=device, **config).start()
        engine.generate(prompt, SamplingParams(max_new_tokens=8))  # warm
        out[f"{name}_start_s"] = time.perf_counter() - t
        ids: list[int] = []

        def run() -> None:
            ids[:] = engine.generate(prompt, params).token_ids

        out[name] = best(run)
        out[f"{name}_cuda_graphs"] = engine.runner.cuda_graphs
        engine.stop()
        return ids

    folio_ids = time_engine("folio")
    # async scheduling the other way than the device's default (off on CUDA, on on a CPU): what it is worth
    out["folio_flipped_same_tokens"] = float(time_engine("folio_flipped", async_scheduling=not default_async(device))
                                             == folio_ids)
    if engine_compile:  # the decode step compiled before its graphs are captured (--compile)
        out["folio_compiled_same_tokens"] = float(time_engine("folio_compiled", compile=True) == folio_ids)
    torch.set_num_threads(baseline_threads)  # the engine set its own count (by the model's size)
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        hf_ids: list[int] = []

        def hf_run() -> None:
            r = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=0, use_cache=True)
            hf_ids[:] = r[0, len(prompt):].tolist()

        out["transformers"] = best(hf_run)
        if compiled:
            out.update(time_compiled_static(hf, ids, new_tokens, best, device, folio_ids))

        def naive() -> None:
            list(generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab))

        out["naive"] = best(naive) if repeats else 0.0
    out["same_tokens_as_transformers"] = float(folio_ids == hf_ids)
    return out


def default_async(device: str) -> bool:
    """Whether the engine runs ahead on `device` by default (async scheduling: model/engine/ahead.py)."""
    return ahead.default_async_scheduling(torch.device(device))


def bench_concurrent(ck: Checkpoint, hf, n: int, new_tokens: int, repeats: int,  # noqa: ANN001
                     baseline_threads: int, device: str = "cpu", sampled: bool = False,
                     flipped: bool = False) -> dict[str, float]:
    """Aggregate tokens/s of n concurrent requests: the engine vs `transformers`' static batch, in alternating
    rounds (this VM's speed drifts by 10-20% over minutes), the best round of each. `sampled`: every request
    samples at temperature 1 from the whole vocabulary (transformers' default top-k of 50 turned off), greedy
    otherwise. `flipped`: also an engine with async scheduling the other way than the device's default, in the
    same rounds ("folio_flipped")."""
    ps = prompts(n, ck.tokenizer.n_vocab, seed=n)
    g = torch.Generator().manual_seed(100 + n)
    lengths = torch.randint(new_tokens // 2, new_tokens + 1, (n,), generator=g).tolist()
    wanted = sum(lengths)
    engines = {"folio": Engine(ck, max_batch_size=n, max_waiting=n, device=device).start()}
    if flipped:
        engines["folio_flipped"] = Engine(ck, max_batch_size=n, max_waiting=n, device=device,
                                          async_scheduling=not default_async(device)).start()
    for engine in engines.values():
        engine.generate(ps[0], SamplingParams(max_new_tokens=8))

    async def folio(engine: Engine) -> float:
        t = time.perf_counter()
        streams = [engine.submit(p, SamplingParams(max_new_tokens=L, stop_at_eos=False, do_sample=sampled,
                                                   temperature=1.0 if sampled else None, seed=i))
                   for i, (p, L) in enumerate(zip(ps, lengths))]
        results = await asyncio.gather(*(s.collect() for s in streams))
        assert sum(r.finished.generated_tokens for r in results) == wanted
        return time.perf_counter() - t

    # transformers: static batch, left padding, runs until the longest request is done
    width = max(len(p) for p in ps)
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def transformers() -> float:
        saved = torch.get_num_threads()
        torch.set_num_threads(baseline_threads)  # the engine sets its own count (by the model's size)
        with torch.inference_mode():
            t = time.perf_counter()
            how = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampled else {"do_sample": False}
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(lengths), pad_token_id=0,
                        **how)
            sync(device)
            elapsed = time.perf_counter() - t
        torch.set_num_threads(saved)
        return elapsed

    seconds: dict[str, list[float]] = {name: [] for name in [*engines, "transformers"]}
    try:
        for _ in range(max(1, repeats)):
            for name, engine in engines.items():
                seconds[name].append(asyncio.run(folio(engine)))
            seconds["transformers"].append(transformers())
    finally:
        for engine in engines.values():
            engine.stop()
    out: dict[str, Any] = {"tokens": wanted, "rounds": max(1, repeats)}
    for name, s in seconds.items():
        out[name], out[f"{name}_all"] = wanted / min(s), [wanted / x for x in s]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_decode", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,gpt2-124m")
    p.add_argument("--checkpoint", default=str(REPO / "weights" / "shakespeare-char"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--sampled-concurrency", default="32", help="concurrent loads run again with every request sampled")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch's threads for transformers and the naive loop (the engine picks its own by model size)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda (the engine's default dtype there, bf16, on both sides)")
    p.add_argument("--compiled-baseline", choices=["auto", "on", "off"], default="auto",
                   help="also time transformers' static cache under torch.compile at batch 1 (auto: on CUDA)")
    p.add_argument("--engine-compile", action="store_true",
                   help="also time the engine with its decode step compiled (--compile; CUDA) at batch 1")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = args.device
    compiled = args.compiled_baseline == "on" or (args.compiled_baseline == "auto" and device.startswith("cuda"))
    dtype = default_dtype(torch.device(device))
    bandwidth = measure_read_bandwidth(device=device)
    report: dict = {"machine": {"cpu": cpu_name(), "threads": args.threads, "read_bandwidth_GBps": bandwidth / 1e9,
                                "torch": torch.__version__, "device": device, "dtype": str(dtype),
                                "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None},
                    "new_tokens": args.new_tokens, "models": {}}
    rows = []
    flipped = "async off" if default_async(device) else "async on"  # the rows of the engine run the other way
    for name in args.models.split(","):
        ck = named_checkpoint(name, args.checkpoint)
        hf = to_hf(ck.model).to(device, dtype)
        weight_bytes = ck.model.num_params() * dtype.itemsize
        ceiling = bandwidth / weight_bytes
        # transformers cannot run past the context: keep prompt (< 48 tokens) + new tokens inside it
        new_tokens = min(args.new_tokens, ck.config.block_size - 48)
        b1 = bench_batch1(ck, hf, new_tokens, args.repeats, args.threads, device, compiled, args.engine_compile)
        entry = {"params": ck.model.num_params(), "weight_bytes": weight_bytes, "ceiling_tok_s": ceiling,
                 "new_tokens": new_tokens,
                 "batch1": b1, "concurrent": {}, "concurrent_sampled": {}}
        rows.append((name, "batch 1", b1["folio"], b1["transformers"], b1["naive"], ceiling))
        fastest = max(b1["folio"], b1.get("folio_compiled", 0.0))  # the engine's best against transformers' best
        if "folio_compiled" in b1:
            rows.append((name, "b1 --compile", b1["folio_compiled"], b1["transformers"], b1["naive"], ceiling))
        if "transformers_compiled" in b1:
            rows.append((name, "b1 vs compile", fastest, b1["transformers_compiled"], float("nan"), float("nan")))
        rows.append((name, "b1 " + flipped, b1["folio_flipped"], float("nan"), float("nan"), float("nan")))
        loads = [int(x) for x in args.concurrency.split(",") if x]
        for n in loads:
            c = bench_concurrent(ck, hf, n, new_tokens, args.repeats, args.threads, device, flipped=n == max(loads))
            entry["concurrent"][str(n)] = c
            rows.append((name, f"{n} concurrent", c["folio"], c["transformers"], float("nan"), float("nan")))
            if "folio_flipped" in c:
                rows.append((name, f"{n} {flipped}", c["folio_flipped"], float("nan"), float("nan"), float("nan")))
        for n in [int(x) for x in args.sampled_concurrency.split(",") if x]:
            c = bench_concurrent(ck, hf, n, new_tokens, args.repeats, args.threads, device, sampled=True)
            entry["concurrent_sampled"][str(n)] = c
            rows.append((name, f"{n} sampled", c["folio"], c["transformers"], float("nan"), float("nan")))
        report["models"][name] = entry
        write_json(Path(args.out_dir) / "engine_decode.json", report)  # after each model: a cut-short run keeps it
    print_table(report, rows, args)
    plot(report, Path(args.out_dir) / "engine_decode.png")
    return 0


def print_table(report: dict[str, Any], rows: list[tuple], args: argparse.Namespace) -> None:
    """The machine, then a row per model and load: tokens/s against transformers, the naive loop, the ceiling."""
    m = report["machine"]
    where = m["gpu"] or f"{m['cpu']}, {args.threads} threads"
    print(f"{m['device']} ({where}, {m['dtype']}), read bandwidth {m['read_bandwidth_GBps']:.1f} GB/s, "
          f"{args.new_tokens} new tokens")
    print(f"{'model':<12} {'load':<14} {'folio tok/s':>11} {'HF tok/s':>9} {'x HF':>6} {'naive':>7} "
          f"{'x naive':>7} {'ceiling':>8} {'% ceil':>6}")
    for name, load, f, h, nv, ceil in rows:
        xn = f"{f / nv:7.2f}" if nv == nv and nv else "      -"
        pc = f"{100 * f / ceil:5.0f}%" if ceil == ceil else "     -"
        cs = f"{ceil:8.1f}" if ceil == ceil else "       -"
        nvs = f"{nv:7.1f}" if nv == nv else "      -"
        print(f"{name:<12} {load:<14} {f:11.1f} {h:9.1f} {f / h:6.2f} {nvs} {xn} {cs} {pc}")


def plot(report: dict[str, Any], png: Path) -> None:
    """Tokens/s per model: Folio's engine and `transformers` side by side, and the bandwidth ceiling."""
    plt = pyplot()
    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        e = report["models"][name]
        loads = [(f"{n} conc.", c) for n, c in e["concurrent"].items()]
        loads += [(f"{n} sampled", c) for n, c in e.get("concurrent_sampled", {}).items()]
        labels = ["batch 1"] + [label for label, _ in loads]
        folio = [e["batch1"]["folio"]] + [c["folio"] for _, c in loads]
        hf = [e["batch1"]["transformers"]] + [c["transformers"] for _, c in loads]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], folio, 0.4, label="Folio engine")
        ax.bar([i + 0.2 for i in x], hf, 0.4, label="transformers generate")
        flipped = [(i, c["folio_flipped"]) for i, c in enumerate([e["batch1"]] + [c for _, c in loads])
                   if "folio_flipped" in c]
        if flipped:
            ax.plot([i - 0.2 for i, _ in flipped], [f for _, f in flipped], "rx", ms=9,
                    label="Folio, async scheduling " + ("off" if default_async(report["machine"]["device"]) else "on"))
        if "transformers_compiled" in e["batch1"]:
            ax.plot([0.2], [e["batch1"]["transformers_compiled"]], "k*", ms=12,
                    label="transformers static cache + torch.compile")
        ax.axhline(e["ceiling_tok_s"], ls="--", c="grey", label="batch-1 bandwidth ceiling")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.set_title(f"{name} ({e['params'] / 1e6:.1f}M params)")
    machine = report["machine"]
    fig.suptitle(f"decode on {machine.get('gpu') or machine.get('cpu')}, {report['new_tokens']} new tokens")
    # one legend under the panels: inside one, it hid the bars
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    save_figure(fig, png, rect=(0, 0.1, 1, 1))


if __name__ == "__main__":
    sys.exit(main())
