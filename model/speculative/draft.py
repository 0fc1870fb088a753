"""Draft-model drafting: a smaller model with the served model's tokenizer proposes each request's next tokens
greedily (`--speculative-model PATH`, vLLM's option).

`DraftModelProposer` runs the draft model through its own model runner (model/engine/runner.py: the draft on the
served model's device and dtype, with a KV-cache row per batch slot, bounded by the draft's context) and keeps, per
request, which tokens that row holds (`DraftRow`). Each proposal first brings the row into step with the request:
the drafted tokens the served model rejected are rolled back (the row is recorded as holding fewer; their keys and
values are overwritten before any query reads them), the tokens it has not seen (the prompt at first, then each
step's accepted and chosen tokens) go in as one chunk whose last logits give the first drafted token, and each
further drafted token is one decode step of all the requests drafting, batched. A drafted token the served model
takes is already in the row: the next step feeds only what is new. Where a request's text outgrows the draft's
context, its row starts again from the latest tokens (a window, as the engine slides the served model's).

A request's draft row is the served model's row number (`begin(row)`): it is the request's while it runs and is
taken over by the next request given that row, so the draft's cache is bounded by its context and the batch, and a
request that finishes frees it with its slot.

`token_cost` is a drafted token's cost in plain steps of the served model at batch 1, which the speculator weighs
against the tokens drafts win (`speculator.best_k`): `measure_token_cost` times the two models' decode steps at
startup, a draft step not being free as a dictionary look-up is (and a small model's step being mostly fixed costs,
which parameter counts would miss).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from model.tokenizer import Tokenizer

TIMED_STEPS = 9  # pairs of decode steps timed by `measure_token_cost` (their ratios' median), after two untimed


class DraftRunner(Protocol):
    """What the proposer needs of the draft's model runner (model/engine/runner.py's `ModelRunner`)."""

    block_size: int
    device: torch.device

    def forward_chunks(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor: ...
    def decode(self, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor: ...
    def decode_context(self) -> contextlib.AbstractContextManager[None]: ...


@dataclass
class DraftRow:
    """One request's row in the draft's KV cache: it holds `fed` at positions 0.., the request's tokens from
    `offset` on (its prompt then output), but for the drafted tokens past `known` the request may have rejected."""

    row: int
    offset: int = 0
    fed: list[int] = field(default_factory=list)
    known: int = 0  # fed[:known] are the request's tokens; the rest were drafted


class DraftModelProposer:
    """Greedy drafts from a draft model (`runner`), for the first `n_vocab` ids (the shared tokenizer's)."""

    def __init__(self, runner: DraftRunner, n_vocab: int, token_cost: float) -> None:
        self.runner, self.n_vocab, self.token_cost = runner, n_vocab, token_cost

    def begin(self, row: int) -> DraftRow:
        return DraftRow(row)

    def propose(self, states: Sequence[DraftRow], prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                ks: Sequence[int]) -> list[list[int]]:
        """`ks[i]` greedy tokens of the draft model after `prompts[i] + outputs[i]` (fewer where the draft's context
        is short: at most half of it)."""
        window = self.runner.block_size
        ks = [min(k, window // 2) for k in ks]
        chunks = [self._catch_up(st, prompt, output, k, window) for st, prompt, output, k in
                  zip(states, prompts, outputs, ks)]
        rows = [st.row for st in states]
        with self.runner.decode_context():
            logits = self.runner.forward_chunks(rows, chunks, [len(st.fed) for st in states])
            for st, chunk in zip(states, chunks):
                st.fed += chunk
                st.known = len(st.fed)
            drafts = [[t] for t in self._greedy(logits)]
            for j in range(1, max(ks)):  # each further token: one decode step of the requests still drafting
                going = [i for i, k in enumerate(ks) if k > j]
                fed = [drafts[i][-1] for i in going]
                logits = self.runner.decode([rows[i] for i in going], fed, [len(states[i].fed) for i in going])
                for i, token, nxt in zip(going, fed, self._greedy(logits)):
                    states[i].fed.append(token)
                    drafts[i].append(nxt)
        return drafts

    @staticmethod
    def _catch_up(st: DraftRow, prompt: list[int], output: list[int], k: int, window: int) -> list[int]:
        """Bring `st` into step with the request's tokens (`prompt + output`, n of them): keep the drafted tokens it
        took, drop the rest, and slide the window where k more positions would not fit; the tokens to feed (at least
        the last one: its logits give the first drafted token)."""
        n = len(prompt) + len(output)
        keep = st.known
        while keep < len(st.fed) and st.offset + keep < n and _token(prompt, output, st.offset + keep) == st.fed[keep]:
            keep += 1
        del st.fed[min(keep, n - st.offset - 1):]
        if n - st.offset + k - 1 > window:  # the last drafted token fed would sit past the draft's context
            st.offset, st.fed = n - max(1, window - k + 1 - window // 8), []
        st.known = len(st.fed)
        start = st.offset + len(st.fed)
        return prompt[start:] + output if start < len(prompt) else output[start - len(prompt):]

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return logits[:, : self.n_vocab].argmax(dim=-1).tolist()


def _token(prompt: list[int], output: list[int], i: int) -> int:
    """Token i of `prompt + output`."""
    return prompt[i] if i < len(prompt) else output[i - len(prompt)]


def check_same_tokenizer(served: Tokenizer, draft: Tokenizer, served_name: str, draft_name: str) -> None:
    """ValueError naming both models where `draft`'s tokenizer is not `served`'s (the same kind, vocabulary and
    ids; chat templates aside): the draft's ids would mean other text."""
    if _identity(served) != _identity(draft):
        raise ValueError(f"the draft model {draft_name} has another tokenizer ({_describe(draft)}) than the served "
                         f"model {served_name} ({_describe(served)}): --speculative-model needs a checkpoint with the "
                         "served model's tokenizer")


def _identity(tokenizer: Tokenizer) -> str:
    config = {k: v for k, v in tokenizer.to_config().items() if k != "chat_template"}
    return json.dumps(config, sort_keys=True)


def _describe(tokenizer: Tokenizer) -> str:
    kind = tokenizer.to_config().get("kind", "?")
    digest = hashlib.sha256(_identity(tokenizer).encode()).hexdigest()[:12]
    return f"{kind}, {tokenizer.n_vocab} tokens, sha256 {digest}"


def measure_token_cost(draft: DraftRunner, served: DraftRunner) -> float:
    """A draft model's decode step in decode steps of the served model, both at batch 1 (row 0, position 0: a
    startup measurement, before any request holds a row): the median ratio over TIMED_STEPS pairs of steps, the two
    models' steps alternating so that both see the same load on a machine shared with other work."""
    with torch.inference_mode(), served.decode_context():
        ratios = []
        for i in range(TIMED_STEPS + 2):
            pair = [_step_seconds(draft), _step_seconds(served)]
            if i >= 2:  # the first pairs warm the caches
                ratios.append(pair[0] / max(pair[1], 1e-9))
    return statistics.median(ratios)


def _step_seconds(runner: DraftRunner) -> float:
    start = time.perf_counter()
    runner.decode([0], [0], [0])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
