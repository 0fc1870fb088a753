"""Running ahead (vLLM's async scheduling): the next decode step's forward, launched on a step's chosen tokens
before the host has looked at them, so that the host's work on a step (its tokens' stops and text, the events
handed to the event loops, the next iteration's admissions) overlaps the device's work on the next one.

A row is run ahead only where the host would feed it the same token at the same position anyway: the scheduler
(model/engine/scheduler.py) leaves out every row that ends at its length or slides its window at this token,
and runs nothing ahead while the next step must first be seen by the host (a request to admit or prefill, a job,
speculative decoding, streamed attention, fault injection). A row that nonetheless ends at this token (its EOS, a
stop sequence, a cancellation) has its logits dropped; the keys and values written for it sit past what its cache
row is recorded to hold (model/engine/prefix_cache.py). Sampling the next step still waits for this step's host
work (penalties, a grammar's mask and a generator's draw depend on it): only the forward runs ahead, so the tokens
are the ones a step at a time gives.

The forward is launched from the engine thread. On a GPU the launch returns at once and the device works while
the host goes on: on by default there. On a CPU the forward is computed where it is launched, so running ahead only
reorders a step's work (and computes the forwards of rows that end at EOS or a stop sequence for nothing): off by
default there. A thread of its own would not help a CPU either: the forward's Python between its kernels and the
host's Python work take turns holding the interpreter's lock (measured: bundled model, batch 1, 2 cores, 337 us
a step without, 411 us with the forward on a second thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.engine.request import Request
from model.engine.runner import ModelRunner


def default_async_scheduling(device: torch.device) -> bool:
    """Whether an engine runs ahead unless told: on CUDA."""
    return device.type == "cuda"


@dataclass
class Ahead:
    """A forward run ahead: `reqs[i]`'s next token, fed at `positions[i]` of cache row `rows[i]`; its `logits`, one
    row each (on a GPU, perhaps not computed yet), or the `error` its launch raised; `fed[i]`, that token as the host
    saw it (None where the request failed choosing it: its row's new keys and values are then not recorded)."""

    reqs: list[Request]
    rows: list[int]
    positions: list[int]
    logits: torch.Tensor | None = None
    error: Exception | None = None
    fed: list[int | None] = field(default_factory=list)


def launch(runner: ModelRunner, reqs: list[Request], tokens: torch.Tensor) -> Ahead:
    """The decode step after this one for `reqs` (each at its `pos`, the token it is choosing now), fed `tokens`
    (on the device, one per request), launched now."""
    ahead = Ahead(reqs, [r.row for r in reqs], [r.pos for r in reqs])
    try:
        ahead.logits = runner.decode(ahead.rows, tokens, ahead.positions, [r.params.adapter for r in reqs])
    except Exception as e:  # its rows decode again, a step at a time
        ahead.error = e
    return ahead
