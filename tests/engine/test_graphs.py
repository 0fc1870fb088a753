"""CUDA graphs' logic on the CPU (model/engine/graphs.py): the buckets, the static buffers, the padding into the
scratch row and the fixed context lengths, run uncaptured (`capture=False`: the step's forward called on the static
buffers instead of replayed). The engine through them must generate exactly what it generates eagerly. The graphs
themselves are captured and replayed in tests/engine/test_cuda.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from model.engine import Engine
from model.engine.graphs import DecodeGraphs, context_buckets, row_buckets
from model.sampling_params import SamplingParams
from model.testing import tiny_checkpoint
from tests.engine.references import together

BLOCK = 160  # context buckets 64, 128, 160


def test_buckets() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(16) == [1, 2, 4, 8, 16]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert row_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert context_buckets(32) == [32]
    assert context_buckets(128) == [64, 128]
    assert context_buckets(1024) == [64, 128, 256, 512, 1024]
    assert context_buckets(BLOCK) == [64, 128, 160]


def graph_engine(make_engine: Callable[..., Engine], **kwargs) -> tuple[Engine, Counter]:
    """An engine whose decode steps go through uncaptured `DecodeGraphs`; the buckets its steps ran, counted."""
    engine = make_engine(tiny_checkpoint(BLOCK), start=False, **kwargs)
    engine.runner.decode_through_graphs(capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None and len(graphs) == len(graphs.rows) * len(graphs.contexts) and not graphs.graphs
    used: Counter = Counter()
    run = graphs.run

    def counted(key: tuple[int, int], *args) -> torch.Tensor:
        used[key] += 1
        return run(key, *args)

    graphs.run = counted  # type: ignore[method-assign]
    return engine.start(), used


def jobs(n: int, sampled: bool = False) -> list[tuple[list[int], SamplingParams]]:
    """Requests of different prompt and output lengths: together they cross every context bucket and slide the
    window (prompt + output > BLOCK)."""
    out = []
    for i in range(n):
        prompt = [(3 * i + 7 * t) % 60 + 1 for t in range(4 + 11 * i)]
        params = SamplingParams(max_new_tokens=30 + 25 * i, stop_at_eos=False,
                                **({"do_sample": True, "seed": 100 + i, "top_k": 20} if sampled else {}))
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32-kernels", "fp64-torch"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_decoding_through_the_graphs_equals_eager_decoding(make_engine: Callable[..., Engine], dtype: torch.dtype,
                                                           sampled: bool) -> None:
    """Concurrent requests of different lengths (batches of 1 to 6 rows padded to 1, 2, 4 and 6; contexts read 64,
    128 and 160 slots): the tokens and their log-probabilities of the eager engine. fp32 runs the CPU kernels'
    blocks, fp64 torch's attention with the mask over the bucket's context."""
    kwargs = {"dtype": dtype, "max_batch_size": 6, "window_shift": 8}
    engine, used = graph_engine(make_engine, **kwargs)
    eager = make_engine(tiny_checkpoint(BLOCK), **kwargs)
    work = jobs(6, sampled)
    got, want = together(engine, work), together(eager, work)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for g, w in zip(got, want):
        assert [t.logprob for t in g.tokens] == pytest.approx([t.logprob for t in w.tokens], abs=1e-5)
    assert sum(r.finished.window_slides for r in got) > 0  # past the window too
    assert {rows for rows, _ in used} >= {1, 2, 4, 6} and {ctx for _, ctx in used} == {64, 128, 160}


def test_speculative_decoding_through_the_graphs(make_engine: Callable[..., Engine]) -> None:
    """Drafted tokens are more rows of the step (the same cache row at successive positions): through the graphs
    while they fit the largest bucket, eagerly beyond; the output is the eager engine's."""
    kwargs = {"max_batch_size": 4, "speculative_model": "[ngram]", "num_speculative_tokens": 4}
    engine, used = graph_engine(make_engine, **kwargs)
    eager = make_engine(tiny_checkpoint(BLOCK), **kwargs)
    work = [([1, 2, 3, 4] * 6, SamplingParams(max_new_tokens=40, stop_at_eos=False)) for _ in range(3)]
    assert [r.token_ids for r in together(engine, work)] == [r.token_ids for r in together(eager, work)]
    assert engine.stats.spec_decode_num_accepted_tokens_total > 0 and used


def test_padding_writes_only_the_scratch_row() -> None:
    """Three rows through the graph of four: each row's logits and cache are the eager step's; the fourth,
    padding row wrote into the scratch row alone."""
    runners = []
    for graphs in (True, False):
        engine = Engine(tiny_checkpoint(BLOCK), device="cpu", dtype=torch.float64, max_batch_size=6)
        if graphs:
            engine.runner.decode_through_graphs(capture=False)
        runners.append(engine.runner)
    graph, eager = runners
    rows, starts = [4, 0, 2], [0, 0, 0]
    chunks = [[5, 6, 7, 8, 9], [t % 50 + 1 for t in range(79)], [3] * 40]
    with torch.inference_mode():
        for r in runners:
            r.forward_chunks(rows, chunks, starts)
        positions = [len(c) for c in chunks]
        assert graph.graphs is not None and graph.graphs.bucket(3, max(positions) + 1) == (4, 128)
        scratch_before = graph.cache.k[:, 6].clone()
        got = graph.decode(rows, [11, 12, 13], positions)
        want = eager.decode(rows, [11, 12, 13], positions)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(graph.cache.k[:, :6], eager.cache.k, rtol=0, atol=1e-10)
    torch.testing.assert_close(graph.cache.v[:, :6], eager.cache.v, rtol=0, atol=1e-10)
    assert not torch.equal(graph.cache.k[:, 6, :, 0], scratch_before[:, :, 0])  # the padding row wrote slot 0
    assert torch.equal(graph.cache.k[:, 6, :, 1:], scratch_before[:, :, 1:])  # and nothing else


def test_a_replay_repeats_the_last_step() -> None:
    """`replay` runs the last step's graph again on its inputs (what bench/step_profile.py times as the step's
    device work): the step's logits again, and the cache as that step left it."""
    engine = Engine(tiny_checkpoint(BLOCK), device="cpu", dtype=torch.float64, max_batch_size=6)
    runner = engine.runner
    runner.decode_through_graphs(capture=False)
    with torch.inference_mode():
        runner.forward_chunks([1, 3], [[5, 6, 7], [8, 9]], [0, 0])
        logits = runner.decode([1, 3], [11, 12], [3, 2])
        cache = runner.cache.k.clone()
        assert runner.graphs is not None
        again = runner.graphs.replay((2, 64))[:2]
    torch.testing.assert_close(again, logits, rtol=0, atol=0)
    assert torch.equal(runner.cache.k, cache)


def test_steps_the_buckets_cannot_hold_run_eagerly() -> None:
    graphs = DecodeGraphs(lambda *a: torch.zeros(1), max_rows=4, block_size=BLOCK, scratch_row=4,
                          device=torch.device("cpu"), capture=False)
    assert graphs.bucket(5, 10) is None  # more rows than the largest bucket
    assert graphs.bucket(4, BLOCK + 1) is None  # cannot happen (positions < block_size), but not a wrong graph
    assert graphs.bucket(3, 65) == (4, 128) and graphs.bucket(1, 1) == (1, 64)


def test_a_stopped_engine_releases_its_graphs(make_engine: Callable[..., Engine]) -> None:
    """Stopping frees the graphs on the engine's thread after its last step (a graph left to the garbage collector
    can be destroyed inside another engine's capture, and fail it)."""
    engine, used = graph_engine(make_engine)
    graphs = engine.runner.graphs
    assert graphs is not None
    engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5, stop_at_eos=False))
    assert used  # the steps went through the graphs
    engine.stop()
    assert engine.runner.graphs is None and engine.runner.cuda_graphs == "released (the engine stopped)"
    assert not graphs.graphs and not graphs.outputs


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_steps_logits() -> None:
    """`--compile`: the step the graphs hold compiled by torch.compile (dynamic shapes, whole graph: the model's
    cached forward must trace without a break) gives the eager step's logits for every bucket it runs; fp64, torch's
    ops (the CPU kernels are not used), uncaptured."""
    runners = []
    for compiled in (True, False):
        engine = Engine(tiny_checkpoint(BLOCK), device="cpu", dtype=torch.float64, max_batch_size=6)
        engine.runner.decode_through_graphs(capture=False, compile=compiled)
        runners.append(engine.runner)
    rows, chunks = [4, 0, 2, 1, 3], [[5, 6, 7], [t % 50 + 1 for t in range(79)], [3] * 40, [1, 2], [7] * 130]
    with torch.inference_mode():
        for r in runners:
            r.forward_chunks(rows, chunks, [0] * len(rows))
        for n in (1, 2, 3, 5):
            positions = [len(c) for c in chunks[:n]]
            got, want = (r.decode(rows[:n], [11] * n, positions) for r in runners)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
