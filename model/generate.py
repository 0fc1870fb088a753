"""Offline generation from a checkpoint (`folio sample`): `python -m model.generate --checkpoint DIR --prompt "ROMEO:"`.

Uses the naive reference loop (no server, no engine); streams text to stdout as it is generated.
"""

from __future__ import annotations

import random
import sys

import torch

from model.checkpoint import CheckpointError, load_checkpoint
from model.cli import ArgumentParser, add_checkpoint_option
from model.reference import generate_naive
from model.sampler import new_generator
from model.sampling_params import SamplingParams, ValidationError
from model.stopping import TextStream
from model.tokenizer import TokenizerError


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m model.generate", description=__doc__.splitlines()[0])
    add_checkpoint_option(p)
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    p.add_argument("--seed", type=int, default=None, help="random seed (drawn and printed when absent)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        seed = args.seed if args.seed is not None else random.randrange(2**31)
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, greedy=args.greedy, do_sample=not args.greedy, seed=seed, stop=tuple(args.stop),
        )
        ck = load_checkpoint(args.checkpoint, device=args.device)
        prompt = ck.tokenizer.encode(args.prompt)
    except (ValidationError, CheckpointError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not params.is_greedy:
        print(f"seed: {seed}", file=sys.stderr)
    eos = ck.tokenizer.eos_id
    stream = TextStream(ck.tokenizer, params.stop, skip_ids=[eos] if eos is not None else [])
    gen = new_generator(seed)
    sys.stdout.write(args.prompt)
    with torch.inference_mode():
        for token, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab,
                                       eos_id=eos, generator=gen):
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
            if stream.stopped_by is not None:
                break
    sys.stdout.write(stream.finish() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
