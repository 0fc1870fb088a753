"""Speculative decoding by prompt lookup (`--speculative-model [ngram]`; a draft model in the `draft` task) against
plain decoding, in the same run, at batch 1 and greedy unless said:

    python -m bench.speculative [--prompts 8] [--repeats 11] [--new-tokens 64] [--k 8] [--copy-model DIR]
        [--draft-model DIR]

Tasks, on the bundled model (a 2.7M-parameter character model trained on tinyshakespeare) unless said:
- `copy`: a passage of the validation text (the last 10%, never trained on), a blank line, then the passage's first
  8 characters: a continuation grounded in its input, which a model that copies continues with the rest of the
  passage (quoting, editing). On `--copy-model` (default: the bundled model fine-tuned to copy by
  `python -m bench.copy_model`, in ~/.cache/folio/copy-model, built first where absent: minutes; the bundled model
  itself never learned to copy: it goes on in its own words, and its drafts are mostly rejected);
- `oracle`: `free` below with drafts that are always right (what plain decoding generates, known beforehand, k
  tokens every step): the engine's speedup where every draft is taken, as on a span a model copies from its prompt;
- `free`: a passage of the validation text continued in the model's own words, `--new-tokens` of them: prompt
  lookup drafts from the prompt and from what the model wrote (a small model repeats its phrases);
- `free-long`: the same, 4x as many tokens (the window slides; the model falls into its loops);
- `sampled`: `free` at temperature 0.8: drafts are mostly rejected (the cost of speculating where it does not pay);
- `free-batch-8`: `free`, 8 requests at once, 4 times over a round (each request's k counts the batch: drafts must
  be surer);
- `draft`: `free` drafted by a draft model instead of prompt lookup (`--speculative-model DIR`): `--draft-model DIR`
  (its tokenizer must be the bundled model's), by default `python -m bench.draft_model`'s, a 2-layer, 64-wide
  character model (trained first where absent: minutes); `--draft-model none` leaves the task out.

Each task runs plain and speculative engines in alternating rounds: the best round of each, the median of the rounds'
ratios, and the ratio of tokens per CPU-second of the process (less disturbed on a machine shared with other work);
greedy tasks check that both texts are identical. Prints a table, writes bench/results/speculative.json and
speculative.png. Ratios are what matter: absolute figures depend on the machine (and on what else runs on it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

from bench import REPO, RESULTS, validation_split
from bench.copy_model import BEGINNING, BUNDLED, PASSAGE, TEXT, copy_model, line_passages
from bench.draft_model import draft_model
from bench.quantize import cpu_name
from bench.report import pyplot, save_figure, write_json
from model.checkpoint import Checkpoint, load_checkpoint
from model.engine import Engine
from model.sampling_params import SamplingParams
from model.speculative import Drafting, NgramProposer, Speculator


def passages(n: int, length: int, seed: int) -> list[str]:
    """`n` passages of the validation text, each starting at a line."""
    return line_passages(validation_split(TEXT.read_text()), n, (length, length), random.Random(seed))


# the batch task's rounds run its 8 requests this many times over: once, a round lasted ~0.15 s and the rounds'
# ratios swung by more than the cost measured (0.905-1.03 for the same code)
TOGETHER_PASSES = 4


def run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]], together: bool, passes: int = 1
        ) -> tuple[float, float, list[str]]:
    """Tokens per second of `jobs` (one after another, or all submitted at once), `passes` times over, of wall time
    and of the process's CPU time (which a machine shared with other work disturbs less: the engine runs on one
    thread, the caller waits), and their texts (the last pass's; every pass makes the same)."""
    async def batch() -> list[Any]:
        streams = [engine.submit(p, q) for p, q in jobs]
        return await asyncio.gather(*(s.collect() for s in streams))

    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for _ in range(passes):
        results = asyncio.run(batch()) if together else [engine.generate(p, q) for p, q in jobs]
        tokens += sum(len(r.tokens) for r in results)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return tokens / seconds, tokens / cpu_seconds, [r.text for r in results]


class OracleSpeculator(Speculator):
    """Drafts what plain greedy decoding generates after each prompt (known beforehand), every step k tokens: the
    engine's speedup where every draft is right, as on the span a model copies from its prompt."""

    def __init__(self, k: int, answers: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(NgramProposer(1, 1), k)
        self.answers = answers

    def drafts(self, requests: list[Drafting], batch: int = 1) -> list[list[int]]:  # type: ignore[override]
        for r in requests:
            done = len(r.output)
            r.spec.drafted = self.answers.get(tuple(r.prompt), [])[done:done + min(self.k_max, r.room)]
        return [r.spec.drafted for r in requests]


def measure(ck: Checkpoint, jobs: list[tuple[list[int], SamplingParams]], *, together: bool, repeats: int,
            k: int, oracle: bool = False, speculative_model: str = "[ngram]") -> dict[str, Any]:
    plain = Engine(ck, device="cpu", threads=1, max_batch_size=max(8, len(jobs)))
    spec = Engine(ck, device="cpu", threads=1, max_batch_size=max(8, len(jobs)),
                  speculative_model=speculative_model, num_speculative_tokens=k)
    if oracle:
        spec.scheduler.speculator = OracleSpeculator(k, {tuple(p): plain.generate(p, q).token_ids for p, q in jobs})
    best = {"plain": 0.0, "speculative": 0.0}
    best_cpu = dict(best)
    ratios = []  # each round's speculative over plain tokens/s
    texts: dict[str, list[str]] = {}
    try:
        for engine in (plain, spec):
            engine.warmup()
        drafts0 = (spec.stats.spec_decode_num_draft_tokens_total, spec.stats.spec_decode_num_accepted_tokens_total,
                   spec.stats.spec_decode_num_drafts_total)
        for _ in range(repeats):  # alternating rounds, the best of each and the ratio of each round
            rates = {}
            for name, engine in (("plain", plain), ("speculative", spec)):
                rates[name], cpu_rate, texts[name] = run(engine, jobs, together, TOGETHER_PASSES if together else 1)
                best[name], best_cpu[name] = max(best[name], rates[name]), max(best_cpu[name], cpu_rate)
            ratios.append(rates["speculative"] / rates["plain"])
        drafted = spec.stats.spec_decode_num_draft_tokens_total - drafts0[0]
        accepted = spec.stats.spec_decode_num_accepted_tokens_total - drafts0[1]
        verified = spec.stats.spec_decode_num_drafts_total - drafts0[2]
    finally:
        plain.stop()
        spec.stop()
    return {
        "plain_tokens_per_s": round(best["plain"], 1), "speculative_tokens_per_s": round(best["speculative"], 1),
        "speedup": round(best["speculative"] / best["plain"], 3),
        "speedup_median_round": round(sorted(ratios)[len(ratios) // 2], 3),
        "plain_tokens_per_cpu_s": round(best_cpu["plain"], 1),
        "speculative_tokens_per_cpu_s": round(best_cpu["speculative"], 1),
        "speedup_cpu_time": round(best_cpu["speculative"] / best_cpu["plain"], 3),
        "identical_text": texts["plain"] == texts["speculative"] if jobs[0][1].is_greedy else None,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "tokens_accepted_per_verification": round(accepted / verified, 2) if verified else None,
        "sample": texts["speculative"][0][:80],
        "draft_token_cost": spec.config.draft_token_cost,
    }


def shown(path: Path) -> str:
    """`path` as the report shows it: relative to the repository, or with ~ for the home directory."""
    if path.resolve().is_relative_to(REPO):
        return str(path.resolve().relative_to(REPO))
    return str(path).replace(str(Path.home()), "~", 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each free-text request generates")
    p.add_argument("--k", type=int, default=8, help="--num-speculative-tokens")
    p.add_argument("--copy-model", type=Path, default=None,
                   help="the model of the copy task (default: python -m bench.copy_model's, built first if absent)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model of the draft task (default: python -m bench.draft_model's; none: no task)")
    args = p.parse_args()
    args.copy_model = args.copy_model or copy_model()
    args.draft_model = None if args.draft_model == "none" else Path(args.draft_model or draft_model())
    bundled, copier = load_checkpoint(BUNDLED), load_checkpoint(args.copy_model)
    greedy = SamplingParams(max_new_tokens=PASSAGE - BEGINNING)
    copy_jobs = [(copier.tokenizer.encode(f"{t}\n\n{t[:BEGINNING]}"), greedy)
                 for t in passages(args.prompts, PASSAGE, seed=1)]
    tok = bundled.tokenizer
    texts = passages(args.prompts, 64, seed=2)
    free = [(tok.encode(t), SamplingParams(max_new_tokens=args.new_tokens)) for t in texts]
    long = [(tok.encode(t), SamplingParams(max_new_tokens=4 * args.new_tokens)) for t in texts]
    sampled = [(tok.encode(t), SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, seed=i))
               for i, t in enumerate(texts)]
    tasks = {
        "copy": (copier, copy_jobs, False),
        "oracle": (bundled, free, False),
        "free": (bundled, free, False),
        "free-long": (bundled, long, False),
        "sampled": (bundled, sampled, False),
        "free-batch-8": (bundled, free[:8], True),
    }
    if args.draft_model:
        tasks["draft"] = (bundled, free, False)
    load = os.getloadavg()[0]  # other work on the machine, before and after (a busy one disturbs every figure)
    results = {}
    for name, (ck, jobs, together) in tasks.items():
        results[name] = measure(ck, jobs, together=together, repeats=args.repeats, k=args.k, oracle=name == "oracle",
                                speculative_model=str(args.draft_model) if name == "draft" else "[ngram]")
        print(name, results[name], flush=True)
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": 1,
                    "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)]},
        "settings": {**vars(args), "copy_model": shown(args.copy_model),
                     "draft_model": args.draft_model and shown(args.draft_model)},
        "tasks": results,
    }
    print(f"{'task':<14}{'plain tok/s':>12}{'spec tok/s':>12}{'speedup':>9}{'median':>8}{'cpu-time':>9}"
          f"{'same text':>10}{'accepted':>10}")
    for name, r in results.items():
        same = "-" if r["identical_text"] is None else ("yes" if r["identical_text"] else "NO")
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        print(f"{name:<14}{r['plain_tokens_per_s']:>12.1f}{r['speculative_tokens_per_s']:>12.1f}"
              f"{r['speedup']:>8.2f}x{r['speedup_median_round']:>7.2f}x{r['speedup_cpu_time']:>8.2f}x{same:>10}"
              f"{rate:>10}")
    write_json(RESULTS / "speculative.json", report)
    plot(report, RESULTS / "speculative.png")


def plot(report: dict[str, Any], png: Path) -> None:
    """Each task's speculative tokens/s as a multiple of plain decoding's (the median round), against the targets
    (2x where the text is copied, 0.95x where drafts are rejected)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    names = list(report["tasks"])
    bars = ax.bar(range(len(names)), [report["tasks"][n]["speedup_median_round"] for n in names], color="#4c72b0")
    ax.bar_label(bars, fmt="%.2fx")
    ax.axhline(1.0, color="#555555", linewidth=0.8)
    ax.axhline(2.0, color="#c44e52", linestyle="--", linewidth=1, label="target where the text is copied")
    ax.axhline(0.95, color="#dd8452", linestyle=":", linewidth=1, label="the most a rejected draft may cost")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 1.18 * max(2.2, *(report["tasks"][n]["speedup_median_round"] for n in names)))
    ax.set_ylabel("tokens/s, x plain decoding")
    ax.set_title(f"Prompt-lookup speculative decoding, batch 1 unless said ({report['machine']['cpu']})", fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    save_figure(fig, png)


if __name__ == "__main__":
    main()
