"""One request's constraint state while it generates (`RowMatcher`), and the masks of a batch's constrained rows,
computed together (`allowed_tokens`): what the engine's output processor uses (model/engine/output.py).

A row's matcher starts when its generation does (the prompt never advances it), is advanced with every token the
row generates, and says when the output is complete (`done`): the grammar allows nothing more, and what was
generated satisfies it. The masks of all the constrained rows of a step are computed in one call into one bitmask
(llguidance's executor spreads the rows over its threads), then unpacked into a boolean (rows, vocabulary) tensor
that the sampler applies per row (model/sampler.py: step 6).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from llguidance import LLExecutor, LLMatcher

from model.sampling_params import CompiledConstraint

_EXECUTOR: LLExecutor | None = None
_BITS = torch.arange(8, dtype=torch.uint8)


def _executor() -> LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = LLExecutor()
    return _EXECUTOR


class ConstraintViolation(RuntimeError):
    """A row's constraint cannot go on: a token it refused, or a state no token of this vocabulary leads on from."""


class RowMatcher:
    """The matcher of one request's output."""

    def __init__(self, constraint: CompiledConstraint) -> None:
        """`constraint`: a `model.structured.Constraint`."""
        self.constraint = constraint
        self.matcher: LLMatcher = constraint.matcher()
        self.words = (constraint.ll_tokenizer.vocab_size + 31) // 32  # int32 words of its bitmask

    def advance(self, token: int) -> None:
        """The row generated `token`. `ConstraintViolation` if the grammar refuses it (the mask allowed it, so only
        an engine bug gets here)."""
        if not self.matcher.consume_token(token):
            raise ConstraintViolation(f"the constraint refused token {token}: {self.error()}")

    @property
    def done(self) -> bool:
        """The grammar allows nothing more, and the output satisfies it."""
        return self.matcher.is_stopped() and self.matcher.is_accepting()

    @property
    def satisfied(self) -> bool:
        """The output so far satisfies the grammar (which may allow more, or only an end of text)."""
        return not self.matcher.is_error() and self.matcher.is_accepting()

    @property
    def stuck(self) -> bool:
        """Nothing more may come (the grammar allows no token of this vocabulary), yet the output is incomplete."""
        return self.matcher.is_error() or (self.matcher.is_stopped() and not self.matcher.is_accepting())

    def error(self) -> str:
        return self.matcher.get_error().strip().splitlines()[0] if self.matcher.is_error() else "no error"


def allowed_tokens(rows: Sequence[RowMatcher], width: int) -> torch.Tensor:
    """Each row's allowed ids, as a (len(rows), width) boolean tensor (ids past the tokenizer's never are), for the
    next token: every matcher's mask in one llguidance call."""
    words = max(r.words for r in rows)
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr([(r.matcher, i) for i, r in enumerate(rows)], bitmask.data_ptr(), words * 4,
                                        len(rows))
    # bit j of little-endian byte b of a row is id 8b + j
    bits = (bitmask.view(torch.uint8)[:, :, None] >> _BITS) & 1
    allowed = bits.view(len(rows), -1).bool()
    if allowed.size(1) >= width:
        return allowed[:, :width]
    return torch.nn.functional.pad(allowed, (0, width - allowed.size(1)))
