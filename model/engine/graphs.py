"""CUDA graphs for decode steps (vLLM's `CUDAGraphRunner`, gpt-fast's `reduce-overhead`): a step's few hundred small
kernels replayed with one launch.

Why: a decode step of GPT-2 small is ~200 kernels of a few microseconds each (per block: two layer norms, four
products, the cache writes and reads, the mask, attention, GELU, two residual adds). Launched one by one from
Python, the launches set the pace, not the GPU: an H200 decoded 181 tokens/s at batch 1, behind the naive loop. A
graph captured once replays all of them from one call.

What a graph is captured for: a number of rows (the decode step's tokens; a bucket of `row_buckets`) and a context
length (the cache slots its attention reads; a bucket of `context_buckets`). A step of n tokens whose positions are
all below L runs the graph of the smallest buckets that hold n and L: its inputs (token ids, positions, cache rows)
are copied into the graphs' static buffers, padded to the bucket; the padding rows write their keys and values
into a scratch cache row (the cache's last, which no request is ever given), at position 0, and their logits are
dropped. A query attends to slots 0..its position of its own row (the cache step's mask), so reading a longer
context than a row holds changes nothing.

Every step the buckets cannot hold runs eagerly (`ModelRunner.decode`'s own forward): more rows than the largest
bucket (speculative decoding's drafted tokens count as rows), and a step with a LoRA adapter (the hooks choose rows
in Python, which a graph cannot replay). On by default on CUDA; `EngineConfig.enforce_eager` (`--enforce-eager`,
vLLM's name) turns them off. With `EngineConfig.compile` (`--compile`) the step is compiled by torch.compile before
it is captured (vLLM's way: inductor fuses the small kernels, the graph removes the launches).

The same buffers, buckets and padding run on any device with `capture=False` (the forward is then called on the
static buffers instead of replayed): the CPU tests check the logic that way, and the GPU tests the graphs.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger("folio.engine")

SMALL_ROW_BUCKETS = (1, 2, 4, 8)  # then every ROW_STEP rows (vLLM: 1, 2, 4, then every 8)
ROW_STEP = 16
SMALLEST_CONTEXT = 64  # the shortest context bucket; then doubling up to the block size

# each row's token id, position and cache row: the three columns of the static inputs (a graph of B rows reads the
# first B rows, one contiguous block, so that a step's inputs go over in one asynchronous copy)
IDS, POSITIONS, ROWS = range(3)

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def row_buckets(max_rows: int) -> list[int]:
    """The row counts graphs are captured for, up to `max_rows` (always among them): 1, 2, 4, 8, then every 16."""
    buckets = [b for b in SMALL_ROW_BUCKETS if b < max_rows]
    buckets += range(ROW_STEP, max_rows, ROW_STEP)
    return sorted({*buckets, max_rows})


def context_buckets(block_size: int) -> list[int]:
    """The context lengths graphs are captured for: 64, 128, ... doubling, and `block_size` last."""
    buckets, length = [], SMALLEST_CONTEXT
    while length < block_size:
        buckets.append(length)
        length *= 2
    return [*buckets, block_size]


def smallest_at_least(buckets: list[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    """The decode step's graphs, one per (rows bucket, context bucket), over static input buffers shared by all of
    them (a graph of B rows reads their first B rows). `forward(ids (B, 1), positions (B, 1), cache rows (B,),
    context)` is the step the graphs hold: logits (B, vocab)."""

    def __init__(self, forward: Forward, *, max_rows: int, block_size: int, scratch_row: int,
                 device: torch.device, capture: bool) -> None:
        self.forward, self.scratch_row, self.device, self.capture = forward, scratch_row, device, capture
        self.rows, self.contexts = row_buckets(max_rows), context_buckets(block_size)
        self.inputs = torch.zeros((max_rows, 3), dtype=torch.long, device=device)
        # the host side of the inputs' copy, pinned so that the copy is asynchronous; reused once the last is done
        self.staging = torch.zeros((max_rows, 3), dtype=torch.long, pin_memory=capture)
        self.padding = torch.tensor([0, 0, scratch_row])  # a padding row: token 0 at the scratch row's slot 0
        self.copied: torch.cuda.Event | None = None
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture_all()

    def __len__(self) -> int:
        """The graphs: one per rows bucket and context bucket."""
        return len(self.rows) * len(self.contexts)

    def bucket(self, n: int, context: int) -> tuple[int, int] | None:
        """The (rows, context) graph a step of `n` rows reading `context` slots runs; None: it runs eagerly."""
        rows, length = smallest_at_least(self.rows, n), smallest_at_least(self.contexts, context)
        return None if rows is None or length is None else (rows, length)

    def run(self, key: tuple[int, int], rows: list[int], tokens: list[int] | torch.Tensor,
            positions: list[int]) -> torch.Tensor:
        """The step of graph `key` (from `bucket`) for these rows: logits (len(rows), vocab), a copy of the graph's
        output (the next replay overwrites it). `tokens`: ids on the host, or a tensor of them on the device (copied
        into the inputs there, after the host's part: nothing waits for them)."""
        n, width = len(rows), key[0]
        if self.copied is not None:
            self.copied.synchronize()  # the last step's inputs are on the device: the staging buffer is free
        staging = self.staging[:width]
        on_device = isinstance(tokens, torch.Tensor)
        staging[:n] = torch.tensor([[0] * n if on_device else tokens, positions, rows]).T
        staging[n:] = self.padding
        self.inputs[:width].copy_(staging, non_blocking=True)
        if on_device:
            self.inputs[:n, IDS].copy_(tokens)
        if self.capture:
            self.copied = torch.cuda.Event()
            self.copied.record()
        return self.replay(key)[:n].clone()

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Graph `key` on the static inputs as they stand (uncaptured: the forward on them). `run` copies a step's
        inputs in first; called alone it repeats the last step, the step's device work without the host's
        (bench/step_profile.py times it). Its output, not a copy."""
        if self.capture:
            self.graphs[key].replay()
            return self.outputs[key]
        return self.forward(*self._views(key[0]), key[1])

    def close(self) -> None:
        """Free the graphs and their memory pool, once the last replay has finished on the device. Called on the
        engine's thread: the stream it replays on is waited for, not the whole device (which another engine, loading
        beside it, may be using or capturing on)."""
        if self.capture:
            torch.cuda.current_stream(self.device).synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def _views(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static inputs of a graph of `width` rows: ids (B, 1), positions (B, 1), cache rows (B,)."""
        return self.inputs[:width, IDS, None], self.inputs[:width, POSITIONS, None], self.inputs[:width, ROWS]

    def _capture_all(self) -> None:
        """Capture every graph, the largest first, in one memory pool (one graph replays at a time, so they share
        the memory their intermediate tensors take)."""
        start = time.perf_counter()
        self.inputs[:, ROWS] = self.scratch_row  # capture writes only into the scratch row
        keys = [(width, context) for width in reversed(self.rows) for context in reversed(self.contexts)]
        # the buffers stay ordinary tensors (a step may run outside inference mode); what graphs compute is not
        with torch.inference_mode():
            # every shape run once first, on a side stream (lazy initialisation, autotuning, and --compile's
            # compiles), as torch.cuda.graphs' docs ask
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for width, context in keys:
                    self.forward(*self._views(width), context)
            torch.cuda.current_stream(self.device).wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            # no garbage collection inside a capture: what it frees on this thread (another engine's graphs, say)
            # may not be freed while this thread's stream captures, and the capture would fail (seen on an H200)
            gc.collect()
            collecting = gc.isenabled()
            gc.disable()
            try:
                for key in keys:
                    self.graphs[key], self.outputs[key] = self._capture(*key, pool)
            finally:
                if collecting:
                    gc.enable()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs of the decode step (rows %s, contexts %s) in %.1f s", len(self.graphs),
                 self.rows, self.contexts, self.capture_seconds)

    def _capture(self, width: int, context: int, pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine's thread (several models, a reload beside a serving model) may wait for the
        # GPU or allocate meanwhile; in the default global mode that call would fail the other engine's step
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = self.forward(*self._views(width), context)
        return graph, out
