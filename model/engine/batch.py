"""The running batch: the requests decoding together and the KV-cache rows held (TGI's `CausalLMBatch`).

A request takes a free cache row when its prefill starts and gives it back when it leaves; it joins the batch
once its whole prompt is in the cache. A decode step reads the batch's rows wherever they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from model.engine.request import Request


class Batch:
    def __init__(self, rows: int) -> None:
        self.requests: list[Request] = []
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __contains__(self, req: Request) -> bool:
        return req in self.requests

    @property
    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    def take_row(self, req: Request, row: int | None = None) -> None:
        """Give `req` cache row `row` (free), or the free row given back last (the scheduler admits no more
        requests than there are rows)."""
        if row is None:
            row = self._free_rows[-1]
        self._free_rows.remove(row)
        req.row = row

    def release_row(self, req: Request) -> None:
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1

    def add(self, req: Request) -> None:
        """`req`'s prompt is in the cache: it decodes with the others from the next step."""
        self.requests.append(req)

    def remove(self, req: Request) -> None:
        """`req` leaves the batch (finished, failed or cancelled) and its row is free for the next request."""
        self.requests.remove(req)
        self.release_row(req)

    def filter(self, leaves: Callable[[Request], bool]) -> list[Request]:
        """Remove every request for which `leaves(req)` is true; the removed ones."""
        gone = [r for r in self.requests if leaves(r)]
        for req in gone:
            self.remove(req)
        return gone

    def clear(self) -> list[Request]:
        return self.filter(lambda _: True)

    def slide(self, req: Request, window_shift: int, block_size: int) -> bool:
        """If `req`'s next token would sit at position `block_size`, keep the last `block_size - window_shift + 1`
        tokens of its window, to be re-prefilled at positions 0..; True when it slid."""
        if req.pos <= block_size:
            return False
        req.context = req.context[-(block_size - window_shift + 1):]
        req.slides += 1
        return True
