"""Perplexity and bits per character of a checkpoint over a text:

    python -m model.eval --checkpoint DIR --data FILE [--stride N] [--batch-size B] [--max-tokens N]

The text is tokenised and cut into windows of the model's context (`block_size` tokens). With the default stride
(the whole context) the windows do not overlap and each one is scored like a prompt sent to the server with
prompt log-probabilities: every token but the window's first, given the tokens before it in the window - the
same numbers the server's `/v1/completions` with `echo` and `max_tokens: 0` gives for that text. A smaller
`--stride` lets each window score only its last `stride` tokens, so that every token is scored with at least
`block_size - stride` tokens of context (Hugging Face's sliding-window perplexity).

Prints tokens and characters scored, the mean negative log-likelihood per token (nats), perplexity
(exp of it) and bits per character (total bits over the characters of the tokens scored).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from model.checkpoint import CheckpointError, load_checkpoint
from model.cli import ArgumentParser, add_checkpoint_option
from model.gpt import GPT
from model.scoring import PromptScorer, TopToken
from model.tokenizer import Tokenizer, TokenizerError


@dataclass(frozen=True)
class Score:
    tokens: int  # tokens scored
    characters: int  # characters those tokens decode to
    nll: float  # total negative log-likelihood, nats

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_character(self) -> float:
        return self.nll / math.log(2) / self.characters


def windows(n_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window: ids[start:end] go in, positions >= first are scored.
    With `stride == block_size` the windows do not overlap and each window's first token is not scored; else every
    position but 0 is scored exactly once."""
    if not 1 <= stride <= block_size:
        raise ValueError(f"stride must be in [1, {block_size}], got {stride}")
    if stride == block_size:
        return [(s, min(s + block_size, n_tokens), s + 1) for s in range(0, n_tokens - 1, block_size)
                if min(s + block_size, n_tokens) - s >= 2]
    out, scored = [], 1
    while scored < n_tokens:
        end = min(scored + stride, n_tokens)
        start = max(0, end - block_size)
        out.append((start, end, scored))
        scored = end
    return out


def score(model: GPT, tokenizer: Tokenizer, ids: list[int], *, stride: int | None = None,
          progress: bool = False) -> Score:
    """Score `ids` window by window (see the module docstring)."""
    block = model.config.block_size
    spans = windows(len(ids), block, stride or block)
    device = model.transformer.wte.weight.device
    describe = lambda t: TopToken(t, "", 0.0, False)  # noqa: E731 (only logprobs are used here)
    nll, tokens, chars = 0.0, 0, 0
    bar = tqdm(total=len(spans), unit="window", disable=not progress)
    with torch.inference_mode():
        for start, end, first in spans:
            scorer = PromptScorer(ids[start:end], 0, tokenizer.n_vocab, describe)
            scorer.add(0, model(torch.tensor([ids[start:end]], device=device))[0])
            for pos, tok in enumerate(scorer.tokens[first - start :], start=first):
                nll -= tok.logprob
                tokens += 1
                chars += len(tokenizer.decode([ids[pos]]))
            bar.update()
    bar.close()
    return Score(tokens, chars, nll)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m model.eval", description=__doc__.splitlines()[0])
    add_checkpoint_option(p)
    p.add_argument("--data", required=True, type=Path, help="a UTF-8 text file")
    p.add_argument("--stride", type=int, default=None, help="tokens scored per window (default: the context)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        ck = load_checkpoint(args.checkpoint, device=args.device)
        ids = ck.tokenizer.encode(args.data.read_text(encoding="utf-8"))[: args.max_tokens]
        if len(ids) < 2:
            raise ValueError(f"{args.data} gives {len(ids)} token(s): at least 2 are needed to score one")
        result = score(ck.model, ck.tokenizer, ids, stride=args.stride, progress=sys.stderr.isatty())
    except (CheckpointError, TokenizerError, OSError, UnicodeDecodeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tokens scored: {result.tokens}")
    print(f"characters:    {result.characters}")
    print(f"nll/token:     {result.nll / result.tokens:.6f} nats")
    print(f"perplexity:    {result.perplexity:.6f}")
    print(f"bits/char:     {result.bits_per_character:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
