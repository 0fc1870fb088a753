"""fp32 against weight-only int8, bf16 and int4 weights, same engine, same run (`python -m bench.quantize`): decode
tokens/s at batch 1 and with concurrent requests, on the bundled model and GPT-2 small's shape (random init), in
alternating rounds (best of each); bytes a batch-1 step reads, the GB/s of weights that makes at each batch (a step
reads them once for all its rows) and the ceiling the read bandwidth implies; and quality against fp32: validation
loss on tiny Shakespeare's last 10% (the bundled model; GPT-2's shape on the same text through GPT-2's BPE, where
its random weights make the loss itself meaningless but the per-token KL divergence from fp32 and the top-1
agreement still say what quantizing changed), and greedy agreement. The loss is measured twice: a whole window a
forward (a prompt's path: more than MAX_ROWS rows go to the GEMMs), and, with the KL divergence and top-1
agreement, through the KV cache MAX_ROWS tokens a forward (the kernels' own products, as decode steps run them).
"int4-head4" is int4 with the LM head int4 too (model/quantize leaves it int8, by this measurement). Prints a
table; writes bench/results/<name>.json and .png (`--name`, default quantize; FOLIO_CPU_KERNELS=avx2 measures the
AVX2 kernels on an AVX-512 CPU)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench import REPO, RESULTS, SHARED_DATA, validation_split
from bench.engine_decode import measure_read_bandwidth, named_checkpoint, prompts
from bench.report import cpu_name, pyplot, save_figure, write_json
from model import kernels
from model.checkpoint import Checkpoint
from model.engine import Engine
from model.eval import score
from model.gpt import KVCache
from model.quantize import Int4Linear, quantize
from model.reference import generate_naive
from model.sampling_params import SamplingParams
from model.tokenizer import gpt2_tokenizer


def variant(ck: Checkpoint, kind: str) -> Checkpoint:
    """A copy of `ck` quantized as `kind` (one of QUANTIZATIONS, or "int4-head4": int4 with the LM head int4 too,
    where "int4" leaves it int8)."""
    model = copy.deepcopy(ck.model)
    head4 = kind == "int4-head4"
    quantize(model, "int4" if head4 else kind)
    if head4:
        model.lm_head = Int4Linear(ck.model.lm_head)
    return Checkpoint(path=ck.path, config=ck.config, tokenizer=ck.tokenizer, model=model.eval(), meta=ck.meta)


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every product's weights (not the embedding table's)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "wte" in name or "wpe" in name or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    head = model.lm_head
    if getattr(head, "weight", None) is not None and head.weight is model.transformer.wte.weight:
        total += head.weight.numel() * head.weight.element_size()  # the tied head reads the table once per step
    return total


def tokens_per_s(ck: Checkpoint, n: int, new_tokens: int) -> float:
    """Aggregate tokens/s of n concurrent greedy requests on a fresh engine (warmed up)."""
    engine = Engine(ck, max_batch_size=max(1, n), max_waiting=n).start()
    ps = prompts(n, ck.tokenizer.n_vocab, seed=n)
    try:
        engine.generate(ps[0], SamplingParams(max_new_tokens=4))

        async def run() -> float:
            t = time.perf_counter()
            streams = [engine.submit(p, SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)) for p in ps]
            await asyncio.gather(*(s.collect() for s in streams))
            return time.perf_counter() - t

        return n * new_tokens / asyncio.run(run())
    finally:
        engine.stop()


def speeds(ck: Checkpoint, kinds: list[str], batches: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    models = {k: ck if k == "fp32" else variant(ck, k) for k in kinds}
    out: dict[str, Any] = {k: {"step_bytes": step_bytes(c.model)} for k, c in models.items()}
    for n in batches:
        best = {k: 0.0 for k in models}
        for _ in range(repeats):  # alternating rounds: this VM's speed drifts over minutes
            for k, c in models.items():
                best[k] = max(best[k], tokens_per_s(c, n, new_tokens))
        for k in models:
            out[k][f"batch{n}"] = best[k]
            out[k][f"over_fp32_batch{n}"] = best[k] / best["fp32"]
            out[k][f"weights_GBps_batch{n}"] = best[k] / n * out[k]["step_bytes"] / 1e9  # steps/s x bytes a step
    return out


def validation_ids(ck: Checkpoint, chars: int) -> list[int] | None:
    """The start of tiny Shakespeare's last 10% in the checkpoint's tokens (GPT-2's BPE for the GPT-2 shape)."""
    text = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if not text.is_file():
        return None
    raw = text.read_text(encoding="utf-8")
    val = validation_split(raw)[:chars]
    if ck.config.vocab_size >= 50257:  # the GPT-2 shape: its own BPE, ids within the random model's vocabulary
        return gpt2_tokenizer(SHARED_DATA / "gpt2-bpe").encode(val)[:4096]  # a 124M forward per token: enough
    return ck.tokenizer.encode(val)


def cached_logits(model: torch.nn.Module, ids: list[int], chunk: int) -> torch.Tensor:
    """The logits (T, vocab) for `ids` (one window) through the KV cache, `chunk` tokens a forward: the rows a
    decode batch's products see (the kernels' own for up to MAX_ROWS rows), the whole window in context."""
    cache = KVCache(model.config, 1, max_len=len(ids))
    out = []
    for start in range(0, len(ids), chunk):
        x = torch.tensor([ids[start:start + chunk]])
        out.append(model(x, cache.step(torch.arange(start, start + x.shape[1])[None]))[0].float())
    return torch.cat(out)


@torch.inference_mode()
def divergence(a: torch.nn.Module, b: torch.nn.Module, ids: list[int], block: int) -> dict[str, float]:
    """Through the KV cache, MAX_ROWS tokens a forward (`cached_logits`), windows of `block` tokens: mean per-token
    KL(a || b) of the next-token distributions, how often their top-1 tokens agree, and each one's mean loss on
    the next tokens."""
    kl, agree, n, nll_a, nll_b = 0.0, 0, 0, 0.0, 0.0
    for start in range(0, len(ids) - 1, block):
        window = ids[start:start + block + 1]
        la, lb = (cached_logits(m, window[:-1], kernels.MAX_ROWS).log_softmax(-1) for m in (a, b))
        kl += (la.exp() * (la - lb)).sum().item()
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        following = torch.tensor(window[1:])[:, None]
        nll_a -= la.gather(1, following).sum().item()
        nll_b -= lb.gather(1, following).sum().item()
        n += la.shape[0]
    return {"kl": kl / n, "top1": agree / n, "loss_a": nll_a / n, "loss_b": nll_b / n}


def quality(ck: Checkpoint, kind: str, chars: int) -> dict[str, Any]:
    ids = validation_ids(ck, chars)
    if ids is None:
        return {"skipped": "tiny Shakespeare not found"}
    q = variant(ck, kind)
    fp32, other = score(ck.model, ck.tokenizer, ids), score(q.model, ck.tokenizer, ids)
    cached = divergence(ck.model, q.model, ids[:2048], min(256, ck.config.block_size))
    n_greedy = 200 if ck.config.n_embd < 768 else 48  # the naive loop is slow on GPT-2's shape
    greedy = SamplingParams(max_new_tokens=n_greedy, greedy=True)
    agree = []
    for prompt in ids[:8], ids[100:108], ids[500:508]:
        a = [t for t, _ in generate_naive(ck.model, prompt, greedy, n_vocab=ck.tokenizer.n_vocab)]
        b = [t for t, _ in generate_naive(q.model, prompt, greedy, n_vocab=ck.tokenizer.n_vocab)]
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    return {"tokens": fp32.tokens, "val_loss_fp32": fp32.nll / fp32.tokens, "val_loss": other.nll / other.tokens,
            "loss_ratio": other.nll / fp32.nll, "kl_from_fp32": cached["kl"], "top1_agreement": cached["top1"],
            "cached_val_loss_fp32": cached["loss_a"], "cached_val_loss": cached["loss_b"],
            "greedy_tokens": n_greedy, "greedy_identical_prefix": agree}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quantize", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "weights" / "shakespeare-char"))
    p.add_argument("--models", default="default,gpt2-124m")
    p.add_argument("--kinds", default="int8,bf16,int4,int4-head4", help="what to compare with fp32")
    p.add_argument("--name", default="quantize", help="the results' file name (bench/results/NAME.json, .png)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quality-chars", type=int, default=50_000)
    p.add_argument("--no-quality", action="store_true", help="speeds only (a second run, another kernel variant)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels.load()
    kinds = ["fp32", *args.kinds.split(",")]
    report: dict[str, Any] = {"machine": {"cpu": cpu_name(), "kernels": kernels.status(), "threads": args.threads,
                                          "read_bandwidth_GBps": measure_read_bandwidth() / 1e9},
                              "kinds": kinds, "models": {}}
    batches = [int(b) for b in args.batches.split(",")]
    bw = report["machine"]["read_bandwidth_GBps"] * 1e9
    for name in args.models.split(","):
        ck = named_checkpoint(name, args.checkpoint)
        m = report["models"][name] = speeds(ck, kinds, batches, args.new_tokens, args.repeats)
        m["quality"] = {} if args.no_quality else {k: quality(ck, k, args.quality_chars) for k in kinds[1:]}
        for k in kinds:
            m[k]["ceiling_batch1"] = bw / m[k]["step_bytes"]
            m[k]["of_ceiling_batch1"] = m[k]["batch1"] / m[k]["ceiling_batch1"] if "batch1" in m[k] else None
    print_table(report, batches)
    out = Path(args.out_dir)
    write_json(out / f"{args.name}.json", report)
    plot(report, batches, out / f"{args.name}.png")
    return 0


def print_table(report: dict[str, Any], batches: list[int]) -> None:
    print(f"CPU: {report['machine']['cpu']}, kernels {report['machine']['kernels']}, "
          f"{report['machine']['threads']} threads, read bandwidth {report['machine']['read_bandwidth_GBps']:.1f} GB/s")
    print(f"{'model':<12}{'weights':<11}{'MB/step':>9}" + "".join(f"{f'batch {n} tok/s, weights':>27}" for n in batches)
          + f"{'of b1 ceiling':>15}")
    for name, m in report["models"].items():
        for k in report["kinds"]:
            row = "".join(f"{m[k][f'batch{n}']:>10.1f} {m[k][f'weights_GBps_batch{n}']:>4.1f} GB/s "
                          f"(x{m[k][f'over_fp32_batch{n}']:.2f})" for n in batches)
            share = m[k]["of_ceiling_batch1"]
            print(f"{name:<12}{k:<11}{m[k]['step_bytes'] / 1e6:>9.1f}{row}{'' if share is None else f'{share:>15.0%}'}")
        for k, q in m["quality"].items():
            if "loss_ratio" in q:
                print(f"{'':<12}{k:<11}quality on {q['tokens']} validation tokens: loss {q['val_loss']:.4f} vs fp32 "
                      f"{q['val_loss_fp32']:.4f} (x{q['loss_ratio']:.4f}); through the cache {q['cached_val_loss']:.4f}"
                      f" vs {q['cached_val_loss_fp32']:.4f}, KL {q['kl_from_fp32']:.2e}, top-1 agreement "
                      f"{q['top1_agreement']:.2%}; greedy identical prefixes {q['greedy_identical_prefix']} "
                      f"of {q['greedy_tokens']}")


def plot(report: dict[str, Any], batches: list[int], png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(report["models"]), figsize=(5 * len(report["models"]), 3.6), squeeze=False)
    for ax, (name, m) in zip(axes[0], report["models"].items()):
        x = range(len(batches))
        width = 0.8 / len(report["kinds"])
        for i, k in enumerate(report["kinds"]):
            ax.bar([v + (i - (len(report["kinds"]) - 1) / 2) * width for v in x], [m[k][f"batch{n}"] for n in batches],
                   width, label=k)
        ax.set_xticks(list(x), [f"batch {n}" for n in batches])
        ax.set_ylabel("tokens/s")
        ax.set_title(name)
        ax.legend()
    fig.suptitle(f"{' vs '.join(report['kinds'])} weights, same engine ({report['machine']['cpu']}, "
                 f"{report['machine']['kernels']})", fontsize=10)
    fig.tight_layout()
    save_figure(fig, png)


if __name__ == "__main__":
    raise SystemExit(main())
