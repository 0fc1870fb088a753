"""What the engine tests check against: the naive reference loop (nanoGPT's cropping loop, a full forward
every step), the engine's sliding window written out with full forwards, log-softmax of the reference's logits,
and small helpers to run and wait."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from model.checkpoint import Checkpoint
from model.engine import Engine, Result
from model.reference import generate_naive
from model.sampler import choose_token, new_generator, usable_logits
from model.sampling_params import SamplingParams

TIMEOUT = 30.0  # seconds any single async test body may take before it counts as hung


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def together(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[Result]:
    """Submit every (prompt, params) at once (they share steps) and collect each result."""
    async def main() -> list[Result]:
        streams = [engine.submit(p, q) for p, q in jobs]
        return await asyncio.gather(*(s.collect() for s in streams))

    return run(main())


def naive(ck: Checkpoint, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """The oracle: nanoGPT's cropping loop, full forward every step."""
    steps = list(generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab, eos_id=ck.tokenizer.eos_id))
    return [t for t, _ in steps], [logits for _, logits in steps]


@torch.no_grad()
def windowed_reference(ck: Checkpoint, prompt: list[int], params: SamplingParams, window_shift: int):
    """The engine's sliding window written out with full forwards: when the context no longer fits, keep its
    last `block_size - window_shift + 1` tokens. The repetition penalty sees the whole history."""
    block = ck.config.block_size
    keep = block - window_shift + 1
    window, history, out, slides = list(prompt), list(prompt), [], 0
    gen = None if params.is_greedy else new_generator(params.seed)
    for _ in range(params.max_new_tokens):
        if len(window) > block:
            window = window[-keep:]
            slides += 1
        logits = ck.model(torch.tensor([window]), take=torch.tensor([-1]))[0, -1]
        token = choose_token(logits, params, n_vocab=ck.tokenizer.n_vocab, context=torch.tensor(history),
                             generator=gen)
        out.append(token)
        window.append(token)
        history.append(token)
    return out, slides


def model_logprobs(ck: Checkpoint, logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(usable_logits(logits.float(), ck.tokenizer.n_vocab), dim=-1)


def assert_logprobs_match(ck: Checkpoint, result: Result, logits: list[torch.Tensor]) -> None:
    """Each reported log-probability is log-softmax of the oracle's logits (so the KV cache is right too)."""
    assert len(result.tokens) == len(logits)
    for ev, lg in zip(result.tokens, logits):
        assert ev.logprob == pytest.approx(model_logprobs(ck, lg)[ev.id].item(), abs=1e-4)


def random_prompt(rng: random.Random, length: int, n_vocab: int) -> list[int]:
    return [rng.randrange(n_vocab) for _ in range(length)]


def slides_expected(prompt_len: int, new_tokens: int, block: int) -> int:
    """With window_shift=1: one slide for every token chosen from a context longer than the window."""
    return sum(1 for n in range(1, new_tokens + 1) if prompt_len + n - 1 > block)


async def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


def hold_steps(engine: Engine) -> tuple[threading.Event, threading.Event]:
    """Hold every step of `engine` in its model step until released (10 s at most): (`entered`, set once a step is
    held; `release`, which lets it and every later step go)."""
    entered, release = threading.Event(), threading.Event()

    def hold(reqs: list) -> None:
        entered.set()
        release.wait(10)

    engine.fault_hook = hold
    return entered, release
