"""The batch: every slot and every KV-cache row (TGI's `CausalLMBatch`, with the rows it holds).

A request takes a slot when it is admitted, and is `prefilling` until its whole prompt is in the cache; it takes a
free cache row at its first prefill chunk (with the longest prefix of its prompt any row holds, prefix reuse) and
is `running` (decoding) from its first token. It gives the slot and the row back in one place, `leave`, however it
ends (finished, failed, cancelled). The batch also knows which tokens each row's cache holds (`RowContents`), which
survive the request that wrote them: a decode step reads the running rows wherever they are. Keys and values depend
on the LoRA adapter a request runs through: a prefix is reused only from a row the same adapter (or the base)
wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from model.engine.prefix_cache import RowContents
from model.engine.request import Request


class Batch:
    def __init__(self, rows: int, *, prefix_cache: bool) -> None:
        self.prefilling: list[Request] = []  # admitted, the prompt not all in the cache yet (oldest first)
        self.running: list[Request] = []  # decoding
        self.contents = RowContents(rows)  # the tokens each row's cache holds
        self.prefix_cache = prefix_cache
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def __len__(self) -> int:
        """Slots taken: requests prefilling or decoding."""
        return len(self.prefilling) + len(self.running)

    def __contains__(self, req: object) -> bool:
        return req in self.running or req in self.prefilling

    def admit(self, req: Request) -> None:
        """`req` takes a slot; its row comes with its first prefill chunk (`take_row`)."""
        self.prefilling.append(req)

    def take_row(self, req: Request, *, reuse: bool, copy: Callable[[int, int, int], None]) -> int:
        """Give `req` a free cache row. With `reuse`, the row holding the longest prefix of its prompt (in place if
        that row is free, else copied into a spare one with `copy(source, row, length)`); the number of prompt tokens
        so found in the cache (the last one is never: its logits are needed). There is always a free row: no more
        requests are admitted than there are rows."""
        if reuse:
            owner = req.params.adapter
            same = [row for row, o in enumerate(self.contents.owners) if o is owner]
            source, held = self.contents.longest(req.prompt, same)
            cached = min(held, len(req.prompt) - 1)
            if cached > 0:
                if source in self._free_rows:
                    self._take(req, source)
                else:
                    self._take(req, self._spare_row())
                    copy(source, req.row, cached)
                    self.contents.wrote(req.row, 0, self.contents.tokens[source][:cached])
                return cached
        self._take(req, self._spare_row() if self.prefix_cache else self._free_rows[-1])
        return 0

    def _spare_row(self) -> int:
        """The free row whose contents are the least loss: the fewest tokens, the one given back last on a tie."""
        return min(reversed(self._free_rows), key=lambda row: len(self.contents.tokens[row]))

    def _take(self, req: Request, row: int) -> None:
        self._free_rows.remove(row)
        req.row = row
        self.contents.own(row, req.params.adapter)

    def start_decoding(self, req: Request) -> None:
        """`req`'s prompt is in the cache: it decodes with the others from now on."""
        self.prefilling.remove(req)
        self.running.append(req)

    def leave(self, req: Request) -> None:
        """`req` gives up its slot and its row (finished, failed or cancelled); the row keeps its contents."""
        (self.running if req in self.running else self.prefilling).remove(req)
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1

    def filter(self, leaves: Callable[[Request], bool]) -> list[Request]:
        """Every request for which `leaves(req)` is true leaves (prefilling ones first); the ones that left."""
        gone = [r for r in self.prefilling + self.running if leaves(r)]
        for req in gone:
            self.leave(req)
        return gone

    def clear(self) -> list[Request]:
        return self.filter(lambda _: True)

    @contextlib.contextmanager
    def writing(self, rows: list[int], starts: list[int], chunks: list[list[int]]) -> Iterator[None]:
        """Around a forward that writes `chunks[i]` at positions starts[i].. of `rows[i]`: recorded once it
        completed; a failed one leaves its rows unknown."""
        try:
            yield
        except BaseException:
            for row in rows:
                self.contents.forget(row)
            raise
        for row, start, chunk in zip(rows, starts, chunks):
            self.contents.wrote(row, start, chunk)

    @staticmethod
    def slide(req: Request, window_shift: int, block_size: int) -> bool:
        """If `req`'s next token would sit at position `block_size`, keep the last `block_size - window_shift + 1`
        tokens of its window, to be re-prefilled at positions 0..; True when it slid."""
        if req.pos <= block_size:
            return False
        req.context = req.context[-(block_size - window_shift + 1):]
        req.slides += 1
        return True
