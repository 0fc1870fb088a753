"""The load generator: prompts of an exact GPT-2 token count, the same for every server, and `measure`, which takes
every figure of one running server through OpenAI's `/v1/completions` (greedy, streaming off)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.peers import MODEL_ID, SEED


class Prompts:
    """Text prompts of an exact GPT-2 token count: space-led lowercase words that are one token each (" the",
    " castle", ...), so every server's tokenizer makes the same ids. Every 512-token prompt starts with a
    different word, so no server has seen any prefix of it before. `restart` replays the same sequence: every
    server gets the same requests."""

    def __init__(self, bpe_dir: Path) -> None:
        from model.tokenizer import gpt2_tokenizer

        tok = gpt2_tokenizer(bpe_dir)
        encoder = json.loads((bpe_dir / "encoder.json").read_text())
        words = sorted(w[1:] for w in encoder if re.fullmatch(r"\u0120[a-z]{3,10}", w))
        self.words = [w for w in words if len(tok.encode(" " + w)) == 1]
        self.restart()

    def restart(self) -> None:
        self.rng = random.Random(SEED)
        self.first_words = self.rng.sample(self.words, len(self.words))

    def short(self, n_tokens: int = 16) -> str:
        return "".join(" " + w for w in self.rng.choices(self.words, k=n_tokens))

    def fresh(self, n_tokens: int) -> str:
        return " " + self.first_words.pop() + self.short(n_tokens - 1)


@dataclass
class Completion:
    seconds: float
    prompt_tokens: int
    completion_tokens: int
    text: str


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int, extra: dict[str, Any]) -> Completion:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False,
            **extra}
    t = time.perf_counter()
    r = await http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
    data = r.json()
    usage = data["usage"]
    return Completion(seconds, usage["prompt_tokens"], usage["completion_tokens"], data["choices"][0]["text"])


def client(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(base_url=url, timeout=900, limits=limits, trust_env=False)


async def ignore_eos_option(url: str) -> dict[str, Any]:
    """{"ignore_eos": True} where the server accepts it (llama.cpp, vLLM), else {} (Folio refuses unknown fields)."""
    async with client(url, 1) as http:
        r = await http.post("/v1/completions", json={"model": MODEL_ID, "prompt": " the", "max_tokens": 1,
                                                     "temperature": 0, "ignore_eos": True})
    return {"ignore_eos": True} if r.status_code == 200 else {}


async def measure(url: str, extra: dict[str, Any], prompts: Prompts, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure for one running server (see the module docstring)."""
    out: dict[str, Any] = {}
    prompts.restart()
    async with client(url, args.concurrency) as http:
        for _ in range(2):  # warm-up: a short request and a long prompt (first-use allocations, lazy init)
            await complete(http, prompts.short(), 8, extra)
            await complete(http, prompts.fresh(args.prompt_tokens), 1, extra)
        agree = await complete(http, args.agreement_prompt, args.agreement_tokens, extra)
        out["agreement_text"] = agree.text

        b1 = [await complete(http, prompts.short(), args.new_tokens, extra) for _ in range(args.repeats)]
        out["batch1"] = {"tok_s": [c.completion_tokens / c.seconds for c in b1],
                         "tokens": [c.completion_tokens for c in b1], "wanted": args.new_tokens}

        rounds = []
        for r in range(args.repeats + 1):  # round 0 warms this concurrency level up and is not counted
            batch = [prompts.short() for _ in range(args.concurrency)]
            t = time.perf_counter()
            done = await asyncio.gather(*(complete(http, p, args.concurrent_new_tokens, extra) for p in batch))
            wall = time.perf_counter() - t
            if r:
                rounds.append({"tok_s": sum(c.completion_tokens for c in done) / wall, "wall_s": wall,
                               "tokens": sum(c.completion_tokens for c in done),
                               "short_requests": sum(c.completion_tokens < args.concurrent_new_tokens for c in done)})
        out["concurrent"] = {"tok_s": [x["tok_s"] for x in rounds], "rounds": rounds, "requests": args.concurrency,
                             "wanted_per_request": args.concurrent_new_tokens}

        fresh, again, prompt_tokens = [], [], []
        for _ in range(args.repeats):
            p = prompts.fresh(args.prompt_tokens)
            first = await complete(http, p, 1, extra)
            second = await complete(http, p, 1, extra)
            fresh.append(first.seconds * 1e3)
            again.append(second.seconds * 1e3)
            prompt_tokens.append(first.prompt_tokens)
        out["ttft_fresh_ms"], out["ttft_again_ms"], out["long_prompt_tokens"] = fresh, again, prompt_tokens
    return out


def agreement(reference: str, text: str, bpe_dir: Path) -> dict[str, Any]:
    """How long `text` stays equal to `reference`: characters, and GPT-2 tokens of the reference's text."""
    from model.tokenizer import gpt2_tokenizer

    n = 0
    while n < min(len(reference), len(text)) and reference[n] == text[n]:
        n += 1
    tok = gpt2_tokenizer(bpe_dir)
    return {"chars": n, "of_chars": len(reference), "tokens": len(tok.encode(reference[:n])),
            "of_tokens": len(tok.encode(reference))}
