"""Running ahead (model/engine/ahead.py): the next decode step's forward launched on a step's chosen tokens before
the host has looked at them. Forced on here, on the CPU (on by default only on CUDA, where the launch returns at
once; tests/engine/test_cuda.py runs it there): the scheduler's logic is the same on every device, so every token
and log-probability must be what a step at a time gives, eagerly and through the (uncaptured) graphs, with requests
ending at EOS, at stop strings and at their length, sliding their windows, waiting for a slot, cancelled
mid-stream, penalised and constrained; and the cache rows it wrote must be recorded truthfully."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import pytest
import torch

from model.engine import Engine, ahead
from model.engine.scheduler import Scheduler
from model.sampling_params import SamplingParams
from model.structured import ConstraintCompiler, ConstraintSpec
from model.testing import tiny_checkpoint
from tests.engine.references import run, together
from tests.engine.test_graphs import BLOCK

EOS = 51  # an id the tiny model often chooses: requests end at it


def work(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """More requests than slots, of every kind a step at a time must agree with: greedy and seeded, ending at EOS,
    at a stop string or at their length, sliding the window (prompt + output > BLOCK), penalised, biased, with
    log-probabilities and alternatives, and one under a regex."""
    regex = ConstraintCompiler().compile(ConstraintSpec.regex("[a-z]{2,6}( [a-z]{2,6}){2,5}[.!?]"), tokenizer)
    kinds = [
        {},
        {"do_sample": True, "seed": 3, "top_k": 20, "stop_at_eos": True},
        {"do_sample": True, "seed": 4, "top_p": 0.8, "temperature": 0.7, "stop_at_eos": True},
        {"stop": ["a", "e"], "max_new_tokens": 60},
        {"do_sample": True, "seed": 5, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "logit_bias": {3: 2.0},
         "stop_at_eos": True},
        {"top_n_tokens": 3, "min_tokens": 5, "stop_at_eos": True},
        {"do_sample": True, "seed": 6, "constraint": regex, "max_new_tokens": 50},
        {"max_new_tokens": 1},
    ]
    out = []
    for i in range(12):
        prompt = [(5 * i + 3 * t) % 60 + 1 for t in range(3 + 13 * i)]
        fields = {"max_new_tokens": 20 + 17 * i, "stop_at_eos": False} | kinds[i % len(kinds)]
        out.append((prompt, SamplingParams(**fields)))
    return out


def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each forward run ahead, as they are launched."""
    launches: list[int] = []
    launch = ahead.launch

    def counting(runner, reqs, tokens):
        launches.append(len(reqs))
        return launch(runner, reqs, tokens)

    monkeypatch.setattr(ahead, "launch", counting)
    return launches


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_running_ahead_generates_what_a_step_at_a_time_generates(make_engine: Callable[..., Engine],
                                                                monkeypatch: pytest.MonkeyPatch, graphs: bool) -> None:
    launches = counted(monkeypatch)
    mixed = []  # steps where some rows were run ahead and others (just prefilled) were not
    decode_step = Scheduler._decode_step

    def watched(self, ready=None):
        if ready is not None:
            mixed.append(any(r.id not in ready.index for r in self.batch.running))
        return decode_step(self, ready)

    monkeypatch.setattr(Scheduler, "_decode_step", watched)
    kwargs = {"max_batch_size": 4, "window_shift": 8}
    engine = make_engine(tiny_checkpoint(BLOCK, eos_id=EOS), start=False, async_scheduling=True, **kwargs)
    replays = []
    if graphs:  # uncaptured: the step's forward on the graphs' static buffers, its ids copied in from a tensor
        engine.runner.decode_through_graphs(capture=False)
        run_graph = engine.runner.graphs.run
        engine.runner.graphs.run = lambda key, *args: replays.append(key) or run_graph(key, *args)
    engine.start()
    plain = make_engine(tiny_checkpoint(BLOCK, eos_id=EOS), async_scheduling=False, **kwargs)
    assert engine.config.async_scheduling and not plain.config.async_scheduling
    got, want = together(engine, work(engine.tokenizer)), together(plain, work(plain.tokenizer))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [t.logprob for t in g.tokens] == pytest.approx([t.logprob for t in w.tokens], abs=1e-5)
        assert [t.top_tokens for t in g.tokens] == [t.top_tokens for t in w.tokens]
        assert g.finished.finish_reason == w.finished.finish_reason
        assert g.finished.window_slides == w.finished.window_slides
    reasons = {r.finished.finish_reason for r in got}
    assert {"length", "stop", "eos_token"} <= reasons and sum(r.finished.window_slides for r in got) > 0
    assert re.fullmatch("[a-z]{2,6}( [a-z]{2,6}){2,5}[.!?]", got[6].finished.generated_text)
    # most decode steps were run ahead, some beside rows that were not
    assert len(launches) > sum(len(r.token_ids) for r in got) / 4 / 2 and True in mixed and False in mixed
    assert bool(replays) == graphs


def test_the_rows_run_ahead_are_recorded_as_what_they_hold(make_engine: Callable[..., Engine],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After requests ran ahead, each cache row is recorded as holding a prefix of what its last request fed it
    (the token that ended a request among them, where its forward had run ahead), and a later request reusing a
    row's prefix gets the tokens it gets from a cold cache."""
    launches = counted(monkeypatch)
    engine = make_engine(tiny_checkpoint(64, eos_id=EOS), async_scheduling=True, max_batch_size=3)
    # greedy, the first two end at EOS (after 8 and 11 tokens), the third at its length
    jobs = [([1 + i, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=30)) for i in (1, 10, 0)]
    results = together(engine, jobs)
    assert [r.finished.finish_reason for r in results] == ["eos_token", "eos_token", "length"] and launches
    contents = engine.scheduler.batch.contents.tokens
    fed = [prompt + r.token_ids for (prompt, _), r in zip(jobs, results)]
    for row in contents:
        assert any(f[: len(row)] == row for f in fed)
    # those that ended at EOS had their EOS fed ahead: recorded (a step at a time never feeds a last token)
    assert sorted(map(len, contents)) == [len(fed[0]), len(fed[1]), len(fed[2]) - 1]
    again = fed[1][:15]
    params = SamplingParams(max_new_tokens=10, stop_at_eos=False)
    cached = engine.stats.cached_prompt_tokens_total
    warm = engine.generate(again, params)
    assert engine.stats.cached_prompt_tokens_total - cached == len(again) - 1  # all but the last prompt token reused
    assert warm.token_ids == make_engine(tiny_checkpoint(64, eos_id=EOS), prefix_cache=False).generate(
        again, params).token_ids


def test_a_request_cancelled_while_running_ahead_ends_alone(make_engine: Callable[..., Engine]) -> None:
    """A stream cancelled mid-generation stops; the forward already run ahead for it is dropped, and the others
    get the tokens they get without it."""
    engine = make_engine(tiny_checkpoint(BLOCK), async_scheduling=True, max_batch_size=4)
    params = SamplingParams(max_new_tokens=80, stop_at_eos=False)
    prompts = [[1 + i, 2, 3] for i in range(3)]

    async def main():
        streams = [engine.submit(p, params) for p in prompts]
        seen = 0
        async for _ in streams[1]:
            seen += 1
            if seen == 10:
                streams[1].cancel()
                break
        return await asyncio.gather(streams[0].collect(), streams[2].collect())

    first, third = run(main())
    assert first.token_ids == engine.generate(prompts[0], params).token_ids
    assert third.token_ids == engine.generate(prompts[2], params).token_ids
    assert engine.stats.cancelled_total == 1 and engine.stats.running == 0


def test_a_forward_run_ahead_that_fails_decodes_its_rows_again(make_engine: Callable[..., Engine],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that raises (a device error, say) costs nothing but time: its rows decode again, a step at a time,
    and the tokens are the ones a step at a time gives."""
    engine = make_engine(tiny_checkpoint(BLOCK), async_scheduling=True, max_batch_size=2)
    decode, calls = engine.runner.decode, []

    def flaky(rows, tokens, *args):
        calls.append(isinstance(tokens, torch.Tensor))
        if isinstance(tokens, torch.Tensor) and len(calls) % 3 == 0:
            raise RuntimeError("the device fell over")
        return decode(rows, tokens, *args)

    monkeypatch.setattr(engine.runner, "decode", flaky)
    jobs = [([1, 2, 3], SamplingParams(max_new_tokens=40, stop_at_eos=False, do_sample=True, seed=s)) for s in (1, 2)]
    got = together(engine, jobs)
    plain = make_engine(tiny_checkpoint(BLOCK), async_scheduling=False, max_batch_size=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in together(plain, jobs)]
    assert calls.count(True) >= 3 and calls.count(False) >= 1  # ahead, failed, and again a step at a time


def test_running_ahead_is_on_by_default_only_on_cuda(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(tiny_checkpoint(), start=False)
    assert engine.config.async_scheduling is False and not engine.scheduler.async_scheduling
    assert make_engine(tiny_checkpoint(), start=False, async_scheduling=True).scheduler.async_scheduling
    assert ahead.default_async_scheduling(torch.device("cuda")) and not ahead.default_async_scheduling(
        torch.device("cpu"))
