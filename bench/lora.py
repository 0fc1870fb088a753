"""What LoRA adapters cost the engine: tokens/s of concurrent requests spread over the base and several adapters
against all on the base, and of one request through an adapter against the base, on GPT-2 124M's shape (random
weights, random rank-`--rank` adapters on c_attn, c_proj and c_fc, written in PEFT's format).

    python -m bench.lora [--concurrency 32] [--adapters 4] [--rank 16] [--new-tokens 64] [--repeats 2]

Every step runs the kernels' fused blocks, which add the adapters' low-rank products for their rows inside the
same call (csrc/block.cpp). Prints the figures and writes bench/results/lora.json and lora.png. Ratios are what
matter: absolute figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench import RESULTS
from bench.engine_decode import gpt2_124m_checkpoint, prompts
from bench.report import cpu_name, pyplot, save_figure, write_json
from model.config import GPTConfig
from model.engine import Engine
from model.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, LoRAConfig, block_linears, peft_key
from model.sampling_params import SamplingParams


def write_adapter(directory: Path, config: GPTConfig, rank: int, seed: int) -> Path:
    """A random adapter for every block's c_attn, c_proj and c_fc, in PEFT's format (model/lora/adapter.py)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_in, n_out) in block_linears(config).items():
        tensors[peft_key(module, "A")] = 0.02 * torch.randn(rank, n_in, generator=g)
        tensors[peft_key(module, "B")] = 0.02 * torch.randn(n_out, rank, generator=g)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / ADAPTER_WEIGHTS_FILE)
    peft = LoRAConfig(r=rank, lora_alpha=2 * rank, target_modules=("c_attn", "c_proj", "c_fc")).to_peft("gpt2")
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(peft))
    return directory


def tokens_per_s(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> float:
    """Every job submitted at once; generated tokens over the wall time until the last ends."""
    async def main() -> int:
        streams = [engine.submit(p, q) for p, q in jobs]
        results = await asyncio.gather(*(s.collect() for s in streams))
        return sum(len(r.tokens) for r in results)

    start = time.perf_counter()
    n = asyncio.run(main())
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: the engine's default)")
    args = p.parse_args()
    ck = gpt2_124m_checkpoint()
    engine = Engine(ck, device="cpu", max_batch_size=args.concurrency, max_loras=args.adapters,
                    threads=args.threads or None).start()
    params = SamplingParams(max_new_tokens=args.new_tokens, greedy=True, stop_at_eos=False)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [engine.load_adapter(f"a{i}", write_adapter(Path(tmp) / f"a{i}", ck.config, args.rank, i))
                    for i in range(args.adapters)]
    engine.warmup()
    asks = prompts(args.concurrency, ck.config.vocab_size)
    spread = [None, *adapters]
    cases = {
        "concurrent_base": [(q, params) for q in asks],
        "concurrent_mixed": [(q, replace(params, adapter=spread[i % len(spread)])) for i, q in enumerate(asks)],
        "batch1_base": [(asks[0], params)],
        "batch1_adapter": [(asks[0], replace(params, adapter=adapters[0]))],
    }
    best = {name: 0.0 for name in cases}
    for _ in range(args.repeats):  # alternating rounds, the best of each
        for name, jobs in cases.items():
            best[name] = max(best[name], tokens_per_s(engine, jobs))
    engine.stop()
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                    "threads": engine.config.threads},
        "settings": vars(args),
        "tokens_per_s": {k: round(v, 1) for k, v in best.items()},
        "mixed_over_base": round(best["concurrent_mixed"] / best["concurrent_base"], 3),
        "batch1_adapter_over_base": round(best["batch1_adapter"] / best["batch1_base"], 3),
    }
    print(f"{'case':<18}{'tokens/s':>10}")
    for name, value in report["tokens_per_s"].items():
        print(f"{name:<18}{value:>10.1f}")
    print(f"mixed / base at {args.concurrency} concurrent: {report['mixed_over_base']:.1%} (target 80%); "
          f"batch 1 adapter / base: {report['batch1_adapter_over_base']:.1%} (target 85%)")
    write_json(RESULTS / "lora.json", report)
    plot(report, RESULTS / "lora.png")


def plot(report: dict[str, Any], png: Path) -> None:
    """The two ratios against their targets."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    cases = [(f"{report['settings']['concurrency']} concurrent over base + {report['settings']['adapters']} "
              f"adapters\nvs all on base", report["mixed_over_base"], 80),
             ("batch 1 through an adapter\nvs the base", report["batch1_adapter_over_base"], 85)]
    bars = ax.bar(range(len(cases)), [100 * r for _, r, _ in cases], color="#4c72b0")
    ax.bar_label(bars, fmt="%.0f%%")
    for i, (_, _, target) in enumerate(cases):
        ax.hlines(target, i - 0.4, i + 0.4, colors="#c44e52", linestyles="--", linewidth=1,
                  label="target" if i == 0 else None)
    ax.set_xticks(range(len(cases)), [c for c, _, _ in cases], fontsize=8)
    ax.set_ylabel("tokens/s, % of the base alone")
    ax.set_ylim(0, 110)
    ax.set_title(f"LoRA adapters' cost, rank {report['settings']['rank']} ({report['machine']['cpu']})",
                 fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, png)


if __name__ == "__main__":
    main()
