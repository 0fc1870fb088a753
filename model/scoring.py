"""Scoring a text: each token's log-probability given the tokens before it, and the most likely alternatives
there - chunk by chunk as the engine prefills a prompt (what lm-evaluation-harness asks for with `echo` and
`max_tokens: 0`), or over a whole forward (`model.inspection`). The same numbers as for generated tokens:
log-softmax of the logits with the unusable ids masked; the first token has no context and no log-probability."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.sampler import usable_logits


@dataclass(frozen=True)
class TopToken:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class PromptToken:
    """A prompt token, scored: its log-probability given the tokens before it (None for the first, which has no
    context) and the most likely alternatives there."""

    id: int
    text: str
    logprob: float | None
    top_tokens: tuple[TopToken, ...] = ()


class PromptScorer:
    def __init__(self, prompt: list[int], top_n: int, n_vocab: int, describe: Callable[[int], TopToken]) -> None:
        self.prompt, self.top_n, self.n_vocab = prompt, top_n, n_vocab
        self.describe = describe  # an id -> its TopToken without a logprob (text, special)
        self.tokens: list[PromptToken] = []
        self._carry: torch.Tensor | None = None  # log-probabilities of the token after the last chunk

    def add(self, start: int, logits: torch.Tensor) -> None:
        """`logits` (n, vocab) of the chunk prompt[start : start + n]: row t predicts prompt[start + t + 1]."""
        logprobs = torch.log_softmax(usable_logits(logits.float(), self.n_vocab), dim=-1)
        ids = self.prompt[start : start + len(logits)]
        if self._carry is None:  # the first chunk: its first token has no context
            self.tokens.append(self._token(ids[0], None, ()))
            rows, targets = logprobs[:-1], ids[1:]
        else:
            rows, targets = torch.cat([self._carry[None], logprobs[:-1]]), ids
        self._carry = logprobs[-1]
        if not targets:
            return
        chosen = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in targets]
        if self.top_n:
            values, top_ids = torch.topk(rows, self.top_n)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        for token, logprob, top in zip(targets, chosen, tops):
            alternatives = tuple(TopToken(t.id, t.text, lp, t.special) for t, lp in
                                 ((self.describe(i), lp) for i, lp in top))
            self.tokens.append(self._token(token, logprob, alternatives))

    def _token(self, token: int, logprob: float | None, top: tuple[TopToken, ...]) -> PromptToken:
        return PromptToken(token, self.describe(token).text, logprob, top)
