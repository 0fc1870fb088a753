"""Stopping and text streaming: small pieces the engine, the reference loop and the offline sampler share.

- `StoppingCriteria`, one per request, owns every reason to stop (length, EOS, stop strings): called with each
  generated token, it returns the text that token releases and the reason generation stops, if it does.
- `check_stop_token` decides, per token, whether generation ends on length or EOS: `(stop, reason)`.
- `StopMatcher` finds stop strings in a stream of text: an Aho-Corasick automaton built once per request, fed
  each new character once, so matching costs O(new text) per token whatever the number and length of the stop
  strings (amortised: a character takes at most one step forward plus the failure steps that earlier forward
  steps paid for).
- `TextStream` turns token ids into text that is safe to show: bytes are held back until they form whole
  UTF-8 characters (byte-level BPE splits characters across tokens), and text that could be the start of
  a stop string is held back until it is known not to be one. A matched stop string ends the stream and is
  not part of the output. Concatenating every delta gives exactly the final text.

Stop strings are bounded (`MAX_STOP_STRINGS` of at most `MAX_STOP_CHARS` characters each): the automaton has at
most their total length in states, and that much text is held back at most.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class _Decodes(Protocol):
    def decode_bytes(self, ids: list[int]) -> bytes: ...


LENGTH = "length"
EOS_TOKEN = "eos_token"
STOP_SEQUENCE = "stop_sequence"
CONSTRAINT_DONE = "stop"  # structured output: the output satisfies its constraint, which allows nothing more
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128


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


class StopMatcher:
    """Aho-Corasick automaton over stop strings. A state is a node of the trie of the stop strings: the longest
    tail of the text fed so far that is a prefix of some stop string, so its depth is exactly how much text
    must be held back. `steps` counts the transitions taken (forward and failure), the matching work done."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        goto: list[dict[str, int]] = [{}]  # trie edges, by node
        depth = [0]
        ends = [-1]  # index of the stop string that is this node's string, else -1
        for k, s in enumerate(self.stop):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                node = nxt
            if ends[node] < 0:
                ends[node] = k
        # failure links (the longest proper suffix that is a trie node) and, per node, the longest stop string
        # that is a suffix of the node's string: the node's own, else its failure node's (breadth first, so that
        # one is known)
        fail = [0] * len(goto)
        longest = list(ends)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if node else 0
                if longest[child] < 0:
                    longest[child] = longest[fail[child]]
                queue.append(child)
        self.goto, self.fail, self.depth, self.longest = goto, fail, depth, longest
        self.steps = 0

    def scan(self, state: int, text: str, offset: int) -> tuple[int, int, int]:
        """Feed `text` (which starts at index `offset` of the whole text) from `state`. Returns the new state and
        the earliest-starting match that ends in `text` as (start index, stop string index), or (-1, -1). Of
        matches with the same start the shortest wins (it ends first)."""
        goto, fail, longest, stop = self.goto, self.fail, self.longest, self.stop
        best_start, best = -1, -1
        steps = 0
        for i, ch in enumerate(text, offset):
            while True:
                steps += 1
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            k = longest[state]
            if k >= 0:
                start = i + 1 - len(stop[k])  # the longest match ending here starts earliest
                if best < 0 or start < best_start:
                    best_start, best = start, k
        self.steps += steps
        return state, best_start, best


class TextStream:
    """Incremental, UTF-8-safe detokenizer with stop-string matching and hold-back."""

    def __init__(self, tokenizer: _Decodes, stop: Sequence[str] = (), skip_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.matcher = StopMatcher(self.stop) if self.stop else None
        self.skip_ids = set(skip_ids)  # special tokens (EOS) that produce no text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._state = 0  # the matcher's state after all the text so far
        self._released: list[str] = []  # the text handed out, in pieces
        self._released_chars = 0
        self._held = ""  # text decoded but not handed out yet: at most the longest stop string
        self.stopped_by: str | None = None

    def arm(self, stop: Sequence[str]) -> None:
        """Match `stop` from now on, in the text of tokens pushed after this call only."""
        self.stop = tuple(stop)
        self.matcher = StopMatcher(self.stop) if self.stop else None
        self._state = 0

    @property
    def text(self) -> str:
        """All text decoded so far (up to the stop string, once matched)."""
        return "".join(self._released) + self._held

    def push(self, token: int) -> str:
        """Add one token; return the text now safe to emit (maybe empty)."""
        if self.stopped_by is not None:
            return ""
        new = "" if token in self.skip_ids else self._decoder.decode(self.tokenizer.decode_bytes([token]))
        return self._release(new, final=False)

    def finish(self) -> str:
        """End of generation: flush incomplete bytes (as U+FFFD) and release held-back text."""
        new = self._decoder.decode(b"", final=True) if self.stopped_by is None else ""
        return self._release(new, final=True)

    def _release(self, new: str, final: bool) -> str:
        held = self._held + new
        keep = 0  # characters held back: the tail that could still begin a stop string
        matcher = self.matcher
        if matcher is not None and self.stopped_by is None:
            if new:
                self._state, start, k = matcher.scan(self._state, new, self._released_chars + len(self._held))
                if k >= 0:  # the earliest-starting match ends the text where it starts
                    held = held[: max(0, start - self._released_chars)]
                    self.stopped_by = self.stop[k]
                    final = True
            keep = 0 if final else min(matcher.depth[self._state], len(held))
        out = held[: len(held) - keep]
        self._held = held[len(held) - keep :]
        if out:
            self._released.append(out)
            self._released_chars += len(out)
        return out


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

    def __call__(self, token: int, *, complete: bool = False) -> StopCheck:
        """`complete`: the request's constraint allows nothing after `token` (structured output), which ends it
        unless EOS or a stop string does."""
        self.generated += 1
        if self.generated == self.min_tokens + 1 and self._stop and not self.stream.stop:
            self.stream.arm(self._stop)  # stop strings count from here on
        text = self.stream.push(token)
        stop, reason = check_stop_token(token, self.generated, self.max_new_tokens, self.eos_id, self.stop_at_eos,
                                        self.min_tokens)
        if self.stream.stopped_by is not None:
            reason = STOP_SEQUENCE
        elif complete and reason != EOS_TOKEN:
            reason = CONSTRAINT_DONE
        elif not stop:
            return StopCheck(text)
        return StopCheck(text + self.stream.finish(), reason, self.stream.stopped_by)
