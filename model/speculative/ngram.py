"""Prompt lookup (n-gram) drafting: the tokens that followed the last occurrence of the text's latest n tokens.

`NgramIndex` keeps, for every n in [n_min, n_max], where each n-gram of a token history last ended (the index of the
token that followed it), and grows with the history one token at a time (O(n_max) per token), so that a draft costs
a few dictionary look-ups whatever the history's length. `propose(k)` takes the longest n first (vLLM's ngram
proposer does too: a longer match predicts better) and, among its occurrences, the latest one (the most recent
context; vLLM v0 took the first). The draft is the k tokens that followed it; where they run into the end of the
history, the draft goes on as the text it matched did (a period repeats: "abcab" drafts "cabca...").
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # per n (index n - n_min): n-gram -> the index of the token that followed its latest occurrence
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max - n_min + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the history."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        history, end = self.tokens, len(self.tokens)
        for n in range(self.n_min, self.n_max + 1):
            # the n-grams ending just before each new token i are followed by it (a later i overwrites an earlier)
            first = max(start, n)
            grams = zip(*(history[first - n + j:end - n + j] for j in range(n)))
            self._follow[n - self.n_min].update(zip(grams, range(first, end)))

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the history's longest matching suffix
        (n_max tokens down to n_min); [] where none occurred before."""
        history = self.tokens
        tail = tuple(history[-self.n_max:])
        for n in range(min(self.n_max, len(history)), self.n_min - 1, -1):
            start = self._follow[n - self.n_min].get(tail[-n:])
            if start is not None:
                draft = history[start:start + k]
                while len(draft) < k:  # the match's continuation reaches the end: the pattern repeats on
                    draft.append(draft[start + len(draft) - len(history)])
                return draft
        return []


class NgramProposer:
    """Prompt lookup's drafts for `Speculator`: per request, an `NgramIndex` over its prompt and output."""

    token_cost = 0.0  # a few dictionary look-ups: nothing beside a model step

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def begin(self, row: int) -> NgramIndex:
        return NgramIndex(self.n_min, self.n_max)

    def propose(self, states: Sequence[NgramIndex], prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                ks: Sequence[int]) -> list[list[int]]:
        """For each request, `ks[i]` tokens (or none) after its `prompts[i]` and `outputs[i]` so far (its index
        catches up with them first)."""
        drafts = []
        for index, prompt, output, k in zip(states, prompts, outputs, ks):
            indexed = len(index.tokens)
            if indexed < len(prompt):
                index.extend(prompt[indexed:])
                indexed = len(prompt)
            index.extend(output[indexed - len(prompt):])
            drafts.append(index.propose(k))
        return drafts
