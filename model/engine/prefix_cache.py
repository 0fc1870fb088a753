"""Prefix reuse: which tokens' keys and values each KV-cache row holds, so that a prompt beginning with tokens a
row already holds (a repeated header, a few-shot prefix, the same prompt again, n samples of one prompt) starts
its prefill after them instead of computing them again.

A row keeps its keys and values after its request leaves. Position p of a row holds the token at position p of
what was fed there (a slid window's tokens from position 0). Padding and failed forwards never count: only the
tokens of a completed forward are recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# a prompt waits for a request still prefilling the same first tokens (at least this many, or all but its last)
MIN_SHARED_PREFIX = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists (binary search over slice comparisons, which run in C)."""
    if not a or not b or a[0] != b[0]:
        return 0
    lo, hi = 1, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shares_prefix(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether prompt `b` begins with enough of `a` to wait for `a`'s keys and values rather than compute its own."""
    need = max(1, min(MIN_SHARED_PREFIX, len(b) - 1))
    return common_prefix(a, b) >= need


class RowContents:
    def __init__(self, rows: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        # what wrote each row's keys and values: the LoRA adapter (model/lora.py), None for the base model
        self.owners: list[object | None] = [None] * rows

    def own(self, row: int, owner: object | None) -> None:
        """`row` is written by `owner` from now on: what another owner wrote there is no prefix of its prompts."""
        if self.owners[row] is not owner:
            self.forget(row)
            self.owners[row] = owner

    def wrote(self, row: int, start: int, tokens: Sequence[int]) -> None:
        """A forward wrote `tokens` at positions start.. of `row` (whatever the row held from `start` on is gone)."""
        held = self.tokens[row]
        del held[start:]
        held.extend(tokens)

    def forget(self, row: int) -> None:
        self.tokens[row] = []

    def longest(self, prompt: Sequence[int], rows: Iterable[int]) -> tuple[int, int]:
        """The row among `rows` holding the longest prefix of `prompt`, and its length ((-1, 0) when none does)."""
        best, length = -1, 0
        for row in rows:
            n = common_prefix(self.tokens[row], prompt)
            if n > length:
                best, length = row, n
        return best, length
