"""Fault injection, a testing aid: off by default, never reachable unless the server was started with
`--fault-injection` (env `FOLIO_FAULT_INJECTION=1`).

When enabled, the engine's `fault_hook` raises inside the model step of any request whose prompt contains
one of the markers below, so that a test against a real `python -m app` process can check that such a
request fails alone (HTTP 424, or a final error event on a stream) while the others complete:

- `FAULT_PREFILL` ("<fault:prefill>"): raises while the prompt is prefilled, before any token;
- `FAULT_DECODE` ("<fault:decode>"): raises in the decode step after `DECODE_AFTER` tokens were generated
  (a request asking for fewer tokens finishes first and never fails);
- `FAULT_STALL` ("<fault:stall>"): the engine step holding the request hangs until the request is cancelled
  (its client gone) or for `STALL_MAX_SECONDS`, whichever comes first: a stuck engine, for the liveness probe
  (`GET /health/live`) to notice.

A marker counts when its token ids appear contiguously in the prompt the model sees (after truncation). With a
character tokenizer that is exactly "the prompt contains the marker text"; a BPE tokenizer may split the marker
differently inside other text, so surround it with newlines there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from model.engine import Request
from model.tokenizer import Tokenizer, TokenizerError

FAULT_PREFILL = "<fault:prefill>"
FAULT_DECODE = "<fault:decode>"
FAULT_STALL = "<fault:stall>"
DECODE_AFTER = 2
STALL_MAX_SECONDS = 60.0


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection hook."""


def _contains(seq: Sequence[int], sub: Sequence[int]) -> bool:
    n = len(sub)
    return n > 0 and any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


def fault_hook(tokenizer: Tokenizer) -> Callable[[list[Request]], None]:
    """The engine's `fault_hook` for the markers above, encoded with `tokenizer`."""
    def ids(marker: str) -> list[int]:
        try:
            return list(tokenizer.encode(marker))
        except TokenizerError:  # the marker is not spellable in this vocabulary: nothing can trigger it
            return []

    prefill_ids, decode_ids, stall_ids = ids(FAULT_PREFILL), ids(FAULT_DECODE), ids(FAULT_STALL)

    def hook(requests: list[Request]) -> None:
        for req in requests:
            if _contains(req.prompt, stall_ids):
                deadline = time.monotonic() + STALL_MAX_SECONDS
                while not req.cancelled and time.monotonic() < deadline:
                    time.sleep(0.01)
            if req.prefilling and _contains(req.prompt, prefill_ids):
                raise InjectedFault(f"injected fault in prefill ({FAULT_PREFILL} in the prompt)")
            if not req.prefilling and len(req.output) >= DECODE_AFTER and _contains(req.prompt, decode_ids):
                raise InjectedFault(f"injected fault in decode ({FAULT_DECODE} in the prompt)")

    return hook
