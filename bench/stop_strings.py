"""What stop strings cost: per token in `TextStream.push`, and for whole requests through the engine.

    python -m bench.stop_strings [--length 128] [--tokens 200] [--batch 8] [--model tiny|bundled]

1. `TextStream.push` per token, 4000 tokens of a character vocabulary, with 16 stop strings of `--length`
   characters vs none: random text with random stop strings (never matched), and a text of one repeated
   character with stop strings that keep matching it up to their last character (the most held back).
2. The engine: `--batch` concurrent greedy requests of `--tokens` tokens each, all with 16 random stop strings of
   `--length` characters (never matched) vs none; wall time and the ratio. On a tiny random model (2 layers,
   n_embd 32: a decode step costs little, so what text handling costs shows) or the bundled one.

Prints the figures; absolute times depend on the machine (and on what else runs on it), the ratios matter.
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

from bench import REPO
from model.checkpoint import Checkpoint, load_checkpoint
from model.config import GPTConfig
from model.engine import Engine
from model.gpt import GPT
from model.sampling_params import SamplingParams
from model.stopping import TextStream
from model.tokenizer import CharTokenizer

N_STOPS = 16


def push_us_per_token(tok: CharTokenizer, ids: list[int], stop: tuple[str, ...], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        stream = TextStream(tok, stop)
        for i in ids:
            stream.push(i)
        stream.finish()
        best = min(best, time.perf_counter() - t)
    return best / len(ids) * 1e6


def bench_push(length: int) -> None:
    chars = [chr(c) for c in range(32, 127)]
    tok = CharTokenizer(chars)
    rng = random.Random(0)
    random_ids = [rng.randrange(len(chars)) for _ in range(4000)]
    random_stops = tuple("".join(rng.choice(chars) for _ in range(length)) for _ in range(N_STOPS))
    same_ids = [tok.stoi["a"]] * 4000
    deep_stops = tuple("a" * (length - 1 - k) + "b" for k in range(N_STOPS))
    for name, ids, stops in [("random text", random_ids, random_stops), ("'aaa...' text", same_ids, deep_stops)]:
        none, some = push_us_per_token(tok, ids, ()), push_us_per_token(tok, ids, stops)
        print(f"TextStream.push, {name}: no stop strings {none:.2f} us/token, {N_STOPS} of {length} characters "
              f"{some:.2f} us/token ({some / none:.1f}x)")


def tiny_checkpoint() -> Checkpoint:
    import torch

    torch.manual_seed(0)
    tok = CharTokenizer([chr(c) for c in range(32, 127)] + ["\n"])
    config = GPTConfig(block_size=256, vocab_size=tok.n_vocab, n_layer=2, n_head=2, n_embd=32)
    return Checkpoint(path=None, config=config, tokenizer=tok, model=GPT(config).eval())  # type: ignore[arg-type]


def bench_engine(ck: Checkpoint, length: int, tokens: int, batch: int) -> None:
    engine = Engine(ck, max_batch_size=batch, max_waiting=0).start()
    rng = random.Random(1)
    chars = ck.tokenizer.chars
    prompt = ck.tokenizer.encode("ROMEO:\n")
    stops = tuple("".join(rng.choice(chars) for _ in range(length)) for _ in range(N_STOPS))

    def run(stop: tuple[str, ...]) -> float:
        params = SamplingParams(max_new_tokens=tokens, greedy=True, stop=stop)
        t = time.perf_counter()
        with ThreadPoolExecutor(batch) as pool:
            results = list(pool.map(lambda _: engine.generate(prompt, params), range(batch)))
        assert all(r.finished.generated_tokens == tokens for r in results)  # no stop string matched
        return time.perf_counter() - t

    try:
        run(())  # warm up
        none = min(run(()) for _ in range(5))
        some = min(run(stops) for _ in range(5))
    finally:
        engine.stop()
    model = "a tiny model" if ck.path is None else ck.path.name
    print(f"engine, {model}, {batch} requests x {tokens} tokens: no stop strings {none:.3f} s, {N_STOPS} of "
          f"{length} characters {some:.3f} s ({some / none:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.stop_strings", description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=128, help="characters per stop string")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model", choices=["tiny", "bundled"], default="tiny")
    args = ap.parse_args()
    bench_push(args.length)
    ck = tiny_checkpoint() if args.model == "tiny" else load_checkpoint(REPO / "weights" / "shakespeare-char")
    bench_engine(ck, args.length, args.tokens, args.batch)


if __name__ == "__main__":
    main()
