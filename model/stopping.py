"""Stopping and text streaming: small pieces the engine, the reference loop and the offline sampler share.

- `StoppingCriteria`, one per request, owns every reason to stop (length, EOS, stop strings): called with each
  generated token, it returns the text that token releases and the reason generation stops, if it does.
- `check_stop_token` decides, per token, whether generation ends on length or EOS: `(stop, reason)`.
- `TextStream` turns token ids into text that is safe to show: bytes are held back until they form whole
  UTF-8 characters (byte-level BPE splits characters across tokens), and text that could be the start of
  a stop string is held back until it is known not to be one. A matched stop string ends the stream and is
  not part of the output. Concatenating every delta gives exactly the final text.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class _Decodes(Protocol):
    def decode_bytes(self, ids: list[int]) -> bytes: ...


LENGTH = "length"
EOS_TOKEN = "eos_token"
STOP_SEQUENCE = "stop_sequence"


def check_stop_token(
    token: int, n_generated: int, max_new_tokens: int, eos_id: int | None, stop_at_eos: bool = True,
    min_tokens: int = 0,
) -> tuple[bool, str | None]:
    """After `token` (the n-th generated): EOS ends first (once `min_tokens` were generated), then the length
    limit."""
    if stop_at_eos and eos_id is not None and token == eos_id and n_generated > min_tokens:
        return True, EOS_TOKEN
    if n_generated >= max_new_tokens:
        return True, LENGTH
    return False, None


class TextStream:
    """Incremental, UTF-8-safe detokenizer with stop-string matching and hold-back."""

    def __init__(self, tokenizer: _Decodes, stop: Sequence[str] = (), skip_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_ids = set(skip_ids)  # special tokens (EOS) that produce no text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # all text decoded so far (up to the stop string, once matched)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None
        self.match_from = 0  # stop strings are matched in text[match_from:] (see `arm`)

    def arm(self, stop: Sequence[str]) -> None:
        """Match `stop` from now on, in the text of tokens pushed after this call only."""
        self.stop = tuple(stop)
        self.match_from = len(self.text)

    def push(self, token: int) -> str:
        """Add one token; return the text now safe to emit (maybe empty)."""
        if self.stopped_by is not None:
            return ""
        if token not in self.skip_ids:
            self.text += self._decoder.decode(self.tokenizer.decode_bytes([token]))
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush incomplete bytes (as U+FFFD) and release held-back text."""
        if self.stopped_by is None:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped_by is None and self.stop:
            # a stop string may begin in already-emitted text only if it overlaps the new tail
            start = max(self.match_from, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                self.stopped_by = s
                final = True
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.match_from), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass(frozen=True)
class StopCheck:
    """What one token did: the text it releases, and why generation stops (None: it goes on)."""

    text: str
    reason: str | None = None
    stop_sequence: str | None = None  # the stop string matched, with reason STOP_SEQUENCE


class StoppingCriteria:
    """Every reason one request stops: EOS (unless `stop_at_eos` is off), `max_new_tokens`, and its stop strings
    (matched across token boundaries in the decoded text, never part of the output; see `TextStream`). Before
    `min_tokens` tokens neither EOS nor a stop string ends it: stop strings are matched in the text generated
    from token `min_tokens + 1` on."""

    def __init__(self, tokenizer: _Decodes, *, max_new_tokens: int, eos_id: int | None, stop: Sequence[str] = (),
                 stop_at_eos: bool = True, min_tokens: int = 0) -> None:
        self.max_new_tokens = max_new_tokens
        self.eos_id = eos_id
        self.stop_at_eos = stop_at_eos
        self.min_tokens = min_tokens
        self.generated = 0
        self.stream = TextStream(tokenizer, stop if min_tokens == 0 else (),
                                 skip_ids=[eos_id] if eos_id is not None else [])
        self._stop = tuple(stop)

    def __call__(self, token: int) -> StopCheck:
        self.generated += 1
        if self.generated == self.min_tokens + 1 and self._stop and not self.stream.stop:
            self.stream.arm(self._stop)  # stop strings count from here on
        text = self.stream.push(token)
        stop, reason = check_stop_token(token, self.generated, self.max_new_tokens, self.eos_id, self.stop_at_eos,
                                        self.min_tokens)
        if self.stream.stopped_by is not None:
            reason = STOP_SEQUENCE
        elif not stop:
            return StopCheck(text)
        return StopCheck(text + self.stream.finish(), reason, self.stream.stopped_by)
