"""Quantized weights' quality beside llama.cpp's on the same weights and prompts (`python -m bench.quant_quality`):
Folio int8, int4 and int4 by GPTQ (`python -m model.quantize --calibration`: 4,096 tokens of the training split)
against Folio fp32, llama.cpp's q8_0, q4_0 and Q4_K_M (`llama-quantize`) against its f32 GGUF,
each engine against its own full-precision reference, on the same token windows of tiny Shakespeare's last 10%
(GPT-2's BPE). Per position: KL(reference || quantized) of the next-token distributions and whether their top-1
tokens agree; the mean over all positions is reported, with the reference's entropy (random-init weights give
near-uniform distributions, where neither figure means much) and a sanity check that Folio fp32 and llama.cpp f32
agree.

llama-server returns, for a generated token, the top `n_probs` of the full softmax before sampling
(`post_sampling_probs: false`), never the whole vocabulary, and nothing for prompt positions: each position is
one `/completion` request for one token whose prompt is the window up to it (the slot's cache keeps the prefix,
so each costs one decode step). Both engines are measured the same way (`bucketed_kl`): the reference's top
`--top-k` tokens plus one bucket for the rest of its mass, the quantized side's probabilities read from its own
top `--top-n` list (a token absent from it is given that list's smallest probability, an upper bound, and counted
as a miss). Merging tokens into a bucket can only lower a KL divergence (the log-sum inequality), so this is a
lower bound on the full KL; Folio's full-vocabulary KL is reported beside it.

Two models of GPT-2's BPE: "trained", a 4-layer, 256-wide GPT-2 (biases, tied head) trained with Folio's trainer
on tiny Shakespeare (once, cached: 38 minutes on 2 shared cores; GPT-2 124M would take far longer), and "gpt2-124m",
GPT-2 small's shape at random init (bench.peers' model). Each is exported to `transformers`' layout and converted
by llama.cpp's own tools (bench.peers.builds, cached under --cache-dir). Also the validation loss ratio of int8 and
int4 on the bundled model, read from a bench.quantize run (`--bundled measure`: measured again by
bench.quantize.quality, slow). Prints a table; writes bench/results/<name>.json and .png.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from bench import REPO, RESULTS, SHARED_DATA, training_split, validation_split
from bench.engine_decode import named_checkpoint
from bench.models import to_hf
from bench.peers import LLAMA_QUANTIZED
from bench.peers.builds import Setup, SetupError
from bench.peers.servers import Server, start, stop
from bench.quantize import cached_logits, quality, variant
from bench.report import cpu_name, pyplot, save_figure, write_json
from model import kernels
from model.checkpoint import Checkpoint, load_checkpoint
from model.quantize.calibration import CALIBRATION_TOKENS, quantize_calibrated
from model.tokenizer import gpt2_tokenizer

OUR_KINDS = ("int8", "int4", "int4-gptq")  # int4-gptq: `python -m model.quantize --calibration` (GPTQ)
BUNDLED_KINDS = ("int8", "int4")  # read from bench.quantize's runs
LLAMA_KINDS = ("q8_0", *LLAMA_QUANTIZED)
# the trained model: Folio's trainer, GPT-2's BPE on tiny Shakespeare; n_embd 256 so that every row is whole
# 256-weight super-blocks of Q4_K (llama-quantize would fall back to another type for a row that is not)
TRAIN_FLAGS = ["--preset", "gpt2-124m", "--n-layer", "4", "--n-head", "4", "--n-embd", "256", "--block-size", "64",
               "--batch-size", "8", "--gradient-accumulation-steps", "1", "--max-iters", "240",
               "--lr-decay-iters", "240", "--warmup-iters", "20", "--learning-rate", "2e-3", "--min-lr", "2e-4",
               "--eval-interval", "80", "--eval-iters", "5", "--log-interval", "10", "--no-progress", "--seed", "1"]


@dataclass
class TopTokens:
    """Each position's most probable next tokens, most probable first."""

    ids: torch.Tensor  # (P, N) long
    logprobs: torch.Tensor  # (P, N) float64

    @staticmethod
    def of(logprobs: torch.Tensor, n: int) -> TopTokens:
        """The top `n` of full log-distributions (P, V)."""
        values, ids = logprobs.topk(n, dim=-1)
        return TopTokens(ids, values.double())

    @staticmethod
    def cat(parts: list[TopTokens]) -> TopTokens:
        return TopTokens(torch.cat([p.ids for p in parts]), torch.cat([p.logprobs for p in parts]))


def bucketed_kl(ref: TopTokens, other: TopTokens, k: int) -> tuple[torch.Tensor, int]:
    """Per position, KL(ref || other) over ref's top `k` tokens plus one bucket holding the rest of each side's
    mass. `other`'s probability of a token is read from its own list; a token missing there gets the list's
    smallest probability (an upper bound on it) and is counted: returns (KL per position (P,), misses)."""
    p = ref.logprobs[:, :k].exp()  # (P, k)
    listed = other.ids[:, None, :] == ref.ids[:, :k, None]  # (P, k, N): where each of ref's tokens is in other's
    found = listed.any(-1)
    q = torch.where(found, (listed * other.logprobs.exp()[:, None, :]).sum(-1), other.logprobs[:, -1:].exp())
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(1e-12)
    kl = (p * (p.log() - q.log())).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
    return kl, int((~found).sum())


def bucketed_entropy(ref: TopTokens, k: int) -> torch.Tensor:
    """Per position, the entropy of ref's top `k` tokens plus the rest as one bucket (a lower bound)."""
    p = ref.logprobs[:, :k].exp()
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    return -(torch.xlogy(p, p).sum(-1) + torch.xlogy(p_rest, p_rest))


def compare(ref: TopTokens, other: TopTokens, k: int) -> dict[str, float]:
    """The figures reported for a quantized engine against its reference."""
    kl, misses = bucketed_kl(ref, other, k)
    return {"kl": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "top1": (ref.ids[:, 0] == other.ids[:, 0]).double().mean().item(), "misses": misses}


# -- the token windows and each engine's distributions on them

def windows(n: int, length: int, bpe_dir: Path) -> list[list[int]]:
    """`n` windows of `length` tokens spread evenly over tiny Shakespeare's last 10%, in GPT-2's BPE."""
    raw = (SHARED_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    ids = gpt2_tokenizer(bpe_dir).encode(validation_split(raw))
    stride = (len(ids) - length) // n
    return [ids[i * stride:i * stride + length] for i in range(n)]


@torch.inference_mode()
def folio_logprobs(model: torch.nn.Module, wins: list[list[int]]) -> torch.Tensor:
    """(P, V) next-token log-distributions at every position of every window, through the KV cache MAX_ROWS tokens
    a forward (the kernels' own products, as decode steps run them)."""
    return torch.cat([cached_logits(model, w, kernels.MAX_ROWS).log_softmax(-1) for w in wins])


def llama_top_tokens(url: str, wins: list[list[int]], n: int) -> TopTokens:
    """Each position's top `n` from llama-server: one `/completion` of one token per position, the window up to
    it as the prompt (token ids: the same tokens as Folio's), the top `n_probs` of the softmax before sampling."""
    ids, logprobs = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for w in wins:
            for i in range(len(w)):
                r = client.post("/completion", json={
                    "prompt": w[:i + 1], "n_predict": 1, "n_probs": n, "post_sampling_probs": False,
                    "temperature": 0, "ignore_eos": True, "cache_prompt": True,
                    "response_fields": ["completion_probabilities"]})
                r.raise_for_status()
                top = r.json()["completion_probabilities"][0]["top_logprobs"]
                ids.append([t["id"] for t in top])
                logprobs.append([t["logprob"] for t in top])
    return TopTokens(torch.tensor(ids), torch.tensor(logprobs, dtype=torch.float64))


def llama_server(setup: Setup, outtype: str, threads: int, context: int) -> Server:
    """llama.cpp's generic x86-64 build (AVX2): the cached native one may come from another CPU of the cache's."""
    return Server(f"llama-{outtype}", [str(setup.llama_tool(native=False)), "-m", str(setup.gguf(outtype)),
                                       "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads), "-tb",
                                       str(threads), "-np", "1", "-c", str(context)])


# -- the models

def trained_setup(cache: Path, bpe_dir: Path, threads: int) -> tuple[Setup, Callable[[], Path]]:
    """The trained model's Setup (its transformers export feeds llama.cpp's converter) and a function returning its
    Folio checkpoint, trained once (TRAIN_FLAGS) and cached."""
    setup = Setup(cache, bpe_dir, model_name="shakespeare-bpe-4l256")
    folio = setup.models / "folio"

    def train() -> None:
        setup.run("train-shakespeare-bpe", [
            sys.executable, "-m", "model.train", "--data", str(SHARED_DATA / "tinyshakespeare" / "input.txt"),
            "--bpe-dir", str(bpe_dir), "--out", str(folio), "--threads", str(threads), "--overwrite", *TRAIN_FLAGS],
            cwd=Path(__file__).resolve().parents[1])

    def checkpoint() -> Path:
        return setup.step("trained model (python -m model.train)", folio / "config.json", train).parent

    setup.make_hf = lambda: to_hf(load_checkpoint(checkpoint()).model)
    return setup, checkpoint


def measure_model(setup: Setup, folio_dir: Path, wins: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"windows": len(wins), "positions": sum(len(w) for w in wins)}
    ck = load_checkpoint(folio_dir)
    print(f"{setup.model_name}: Folio fp32 ...", flush=True)
    ref_full = folio_logprobs(ck.model, wins)
    ref = TopTokens.of(ref_full, args.top_n)
    out["entropy_fp32"] = -(ref_full.exp() * ref_full).sum(-1).mean().item()
    out["entropy_fp32_bucketed"] = bucketed_entropy(ref, args.top_k).mean().item()
    out["max_entropy"] = float(torch.log(torch.tensor(float(ck.tokenizer.n_vocab))))
    folio: dict[str, Any] = {}
    for kind in OUR_KINDS:
        print(f"{setup.model_name}: Folio {kind} ...", flush=True)
        full = folio_logprobs(calibrated(ck, args.calibration_tokens) if kind == "int4-gptq" else
                              variant(ck, kind).model, wins)
        folio[kind] = {**compare(ref, TopTokens.of(full, args.top_n), args.top_k),
                       "kl_full_vocab": (ref_full.exp() * (ref_full - full)).sum(-1).mean().item()}
        del full
    out["folio"] = folio
    llama: dict[str, Any] = {}
    tops: dict[str, TopTokens] = {}
    for outtype in ("f32", *LLAMA_KINDS):
        print(f"{setup.model_name}: llama.cpp {outtype} ...", flush=True)
        try:
            server = llama_server(setup, outtype, args.llama_threads, max(len(w) for w in wins) + 4)
            proc, url = start(server, setup.logs / f"quant-quality-{setup.model_name}-{outtype}.log", timeout=300)
        except SetupError as e:
            llama[outtype] = {"error": str(e)}
            continue
        try:
            t = time.perf_counter()
            tops[outtype] = llama_top_tokens(url, wins, args.top_n)
            llama[outtype] = {"seconds": time.perf_counter() - t}
        finally:
            stop(proc)
        if outtype != "f32" and "f32" in tops:
            llama[outtype].update(compare(tops["f32"], tops[outtype], args.top_k))
    out["llama"] = llama
    if "f32" in tops:  # the two references: the same weights, so nearly the same distributions
        sanity = compare(ref, tops["f32"], args.top_k)
        sanity["max_abs_top1_logprob_diff"] = (ref.logprobs[:, 0] - tops["f32"].logprobs[:, 0]).abs().max().item()
        out["folio_fp32_vs_llama_f32"] = sanity
        out["entropy_llama_f32_bucketed"] = bucketed_entropy(tops["f32"], args.top_k).mean().item()
    return out


def calibrated(ck: Checkpoint, tokens: int) -> torch.nn.Module:
    """A copy of `ck`'s model in int4 by GPTQ, calibrated on `tokens` tokens of tiny Shakespeare's training split
    (the windows measured are from the rest), as `python -m model.quantize --calibration` does."""
    model = copy.deepcopy(ck.model)
    raw = (SHARED_DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    t = time.perf_counter()
    quantize_calibrated(model, ck.tokenizer.encode, ck.config.block_size,
                        training_split(raw).encode("utf-8"), "tinyshakespeare (training split)",
                        tokens)
    print(f"  GPTQ, {tokens} calibration tokens: {time.perf_counter() - t:.1f} s", flush=True)
    return model.eval()


def bundled_from(path: Path) -> dict[str, Any]:
    """The bundled model's int8 and int4 quality from a bench.quantize run; where that run also has an int4 with the
    LM head int8 ("int4-head8", before model/quantize made that its int4), that one is int4."""
    report = json.loads(path.read_text())
    q = report["models"]["default"]["quality"]
    return {"int8": q["int8"], "int4": q.get("int4-head8", q["int4"]),
            "source": f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} ({report['machine']['cpu']})"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_quality", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="trained,gpt2-124m")
    p.add_argument("--windows", type=int, default=24, help="token windows for the trained model")
    p.add_argument("--gpt2-windows", type=int, default=4, help="for GPT-2 124M (its llama.cpp steps are slower)")
    p.add_argument("--window-len", type=int, default=60, help="tokens a window (the trained model's context: 64)")
    p.add_argument("--top-n", type=int, default=100, help="tokens each engine lists per position (n_probs)")
    p.add_argument("--top-k", type=int, default=40, help="the reference's tokens the KL keeps; the rest: a bucket")
    p.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS, help="int4-gptq's calibration")
    p.add_argument("--bundled", default=str(RESULTS / "quantize_int4.json"),
                   help="bench.quantize's JSON to read the bundled model's figures from, or 'measure' (slow)")
    p.add_argument("--quality-chars", type=int, default=50_000, help="the bundled model's text, with 'measure'")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="Folio's torch threads")
    # not a timing benchmark: on a loaded machine llama.cpp's threads spin at a barrier for one another that the
    # scheduler has preempted (3.6 s a 124M decode step at 2 threads here, 0.13 s at 1)
    p.add_argument("--llama-threads", type=int, default=1)
    p.add_argument("--bpe-dir", default=str(SHARED_DATA / "gpt2-bpe"))
    p.add_argument("--cache-dir", default=os.environ.get("FOLIO_PEERS_CACHE",
                                                         str(Path.home() / ".cache" / "folio-peers")))
    p.add_argument("--name", default="quant_quality")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.top_k > args.top_n:
        p.error(f"--top-k must be at most --top-n ({args.top_n}), got {args.top_k}")
    torch.set_num_threads(args.threads)
    kernels.load()
    cache, bpe_dir = Path(args.cache_dir), Path(args.bpe_dir)
    report: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "kernels": kernels.status(), "threads": args.threads},
        "llama_threads": args.llama_threads, "window_len": args.window_len, "top_n": args.top_n, "top_k": args.top_k,
        "models": {}}
    for name in args.models.split(","):
        if name == "trained":
            setup, checkpoint = trained_setup(cache, bpe_dir, args.threads)
            folio_dir, wins = checkpoint(), windows(args.windows, args.window_len, bpe_dir)
        elif name == "gpt2-124m":
            setup = Setup(cache, bpe_dir)
            folio_dir, wins = setup.folio_checkpoint(), windows(args.gpt2_windows, args.window_len, bpe_dir)
        else:
            p.error(f"--models: each of trained, gpt2-124m; got {name!r}")
        report["models"][name] = measure_model(setup, folio_dir, wins, args)
        report["models"][name]["setup"] = setup.steps
    if args.bundled == "measure":
        bundled = named_checkpoint("default")
        report["bundled"] = {k: quality(bundled, k, args.quality_chars) for k in BUNDLED_KINDS}
    else:
        report["bundled"] = bundled_from(Path(args.bundled))
    print_table(report)
    out = Path(args.out_dir)
    write_json(out / f"{args.name}.json", report)
    plot(report, out / f"{args.name}.png")
    return 0


def rows(m: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, figures) for each quantized engine of one model, Folio's first."""
    return [(f"Folio {k}", m["folio"][k]) for k in OUR_KINDS] + [(f"llama.cpp {k}", m["llama"].get(k, {}))
                                                                   for k in LLAMA_KINDS]


def print_table(report: dict[str, Any]) -> None:
    print(f"CPU: {report['machine']['cpu']}, kernels {report['machine']['kernels']}; KL over the reference's top "
          f"{report['top_k']} + the rest, each side's top {report['top_n']}")
    for name, m in report["models"].items():
        print(f"\n{name}: {m['positions']} positions, fp32 entropy {m['entropy_fp32']:.3f} nats "
              f"(uniform: {m['max_entropy']:.3f})")
        s = m.get("folio_fp32_vs_llama_f32")
        if s:
            print(f"  sanity, Folio fp32 vs llama.cpp f32: KL {s['kl']:.2e}, top-1 {s['top1']:.2%}, "
                  f"max |d top-1 logprob| {s['max_abs_top1_logprob_diff']:.1e}")
        print(f"  {'weights':<18}{'KL (top-k+rest)':>16}{'KL p99':>10}{'top-1':>9}{'misses':>8}{'KL full vocab':>15}")
        for label, f in rows(m):
            if "kl" not in f:
                print(f"  {label:<18}{f.get('error', 'not measured')}")
                continue
            full = f"{f['kl_full_vocab']:>15.2e}" if "kl_full_vocab" in f else ""
            print(f"  {label:<18}{f['kl']:>16.2e}{f['kl_p99']:>10.2e}{f['top1']:>9.2%}{f['misses']:>8}{full}")
    print(f"\nbundled model (char-level), validation loss against fp32, from {report['bundled'].get('source', 'here')}")
    for k, q in report["bundled"].items():
        if isinstance(q, dict) and "loss_ratio" in q:
            print(f"  Folio {k}: {q['val_loss']:.4f} vs {q['val_loss_fp32']:.4f} (x{q['loss_ratio']:.4f}), "
                  f"KL {q['kl_from_fp32']:.2e}, top-1 {q['top1_agreement']:.2%}")


def plot(report: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    models = report["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 6), squeeze=False)
    for col, (name, m) in enumerate(models.items()):
        measured = [(label, f) for label, f in rows(m) if "kl" in f]
        labels = [label.replace("llama.cpp ", "llama ") for label, _ in measured]
        colors = ["tab:blue" if label.startswith("Folio") else "tab:orange" for label in labels]
        axes[0][col].bar(labels, [f["kl"] for _, f in measured], color=colors)
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("mean KL from own fp32 (nats)")
        axes[0][col].set_title(f"{name} (fp32 entropy {m['entropy_fp32']:.2f} nats)")
        axes[1][col].bar(labels, [100 * f["top1"] for _, f in measured], color=colors)
        axes[1][col].set_ylim(min(100 * f["top1"] for _, f in measured) - 2, 100)
        axes[1][col].set_ylabel("top-1 agreement with own fp32 (%)")
        for ax in axes[:, col]:
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"quantized vs own full precision, same weights and prompts ({report['machine']['cpu']})",
                 fontsize=10)
    save_figure(fig, png)


if __name__ == "__main__":
    raise SystemExit(main())
