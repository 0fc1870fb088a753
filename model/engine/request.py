"""One request's state inside the engine: its prompt, parameters, cache row, window and output so far."""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.engine.events import Event, PromptToken
from model.sampler import SampleRow
from model.sampling_params import SamplingParams
from model.scoring import PromptScorer
from model.speculative import Speculation
from model.stopping import StoppingCriteria
from model.structured.matcher import RowMatcher


@dataclass(eq=False)  # compared by identity: two requests are never the same request
class Request:
    id: int
    prompt: list[int]  # the prompt the model sees (after truncation)
    params: SamplingParams
    seed: int | None  # what its sampler is seeded with; None when greedy (nothing is sampled)
    sink: Callable[[Event], None]  # where its events go (thread-safe)
    truncated: int = 0  # prompt tokens cut from the left by `truncate`
    context: list[int] = field(default_factory=list)  # tokens the model sees (the window)
    output: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # what each token released
    prefilled: int = 0  # prompt tokens already in the cache
    pos: int = 0  # position of the next token fed to the model
    row: int = -1  # its cache row, from its first prefill step until it leaves
    slides: int = 0
    cancelled: bool = False
    generator: torch.Generator | None = None
    stopping: StoppingCriteria | None = None
    scorer: PromptScorer | None = None  # with `params.prompt_logprobs`
    matcher: RowMatcher | None = None  # with `params.constraint`: its output's state in the grammar
    speculation: Speculation | None = None  # its drafting state, where it speculates (model/speculative/)
    submitted_at: float = field(default_factory=time.perf_counter)
    # the submitter's context (made where the request is made): log lines about the request are written in it, so
    # they carry what the caller keeps there, such as the server's request ID (app/http/requestlog.py)
    caller: contextvars.Context = field(default_factory=contextvars.copy_context)

    @property
    def prefilling(self) -> bool:
        """Its prompt is not all in the cache yet."""
        return self.prefilled < len(self.prompt)

    def prompt_scores(self) -> tuple[PromptToken, ...] | None:
        return None if self.scorer is None else tuple(self.scorer.tokens)

    def warn(self, log: logging.Logger, message: str, *args: object) -> None:
        """`log.warning(message, *args)` about this request, in its submitter's context."""
        self.caller.run(log.warning, message, *args)

    def sample_row(self, allowed: torch.Tensor | None = None, ahead: list[int] | None = None) -> SampleRow:
        """What the sampler needs of this request; `allowed`: the ids its constraint allows next; `ahead`: drafted
        tokens taken as already generated (speculative decoding verifies the position after them)."""
        p = self.params
        output = self.output + ahead if ahead else self.output
        # the repetition penalty sees every id so far (prompt and output): `context` is only the window once slid
        history = self.prompt + output if p.repetition_penalty not in (None, 1.0) else ()
        return SampleRow(p, self.generator, history, output if p.penalises_output else (), allowed)
