"""The engine, quantized weights and training on a CUDA device (bf16 by default there): skipped, with the reason,
on machines without one."""

from __future__ import annotations

import gc
import math
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model import sampler as sampler_module
from model.checkpoint import Checkpoint, load_checkpoint
from model.engine import Engine
from model.engine import ahead as ahead_module
from model.quantize import quantize
from model.reference import generate_naive
from model.sampler import draw, new_generator, uniforms
from model.sampling_params import SamplingParams
from model.structured import ConstraintCompiler, ConstraintSpec
from model.testing import tiny_checkpoint
from tests.engine.references import together
from tests.engine.test_graphs import BLOCK
from tests.engine.test_graphs import jobs as graph_jobs
from tests.sampling.distributions import inverse_cdf
from tests.sampling.test_filters import edited_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine"),
]


def test_fp32_greedy_on_cuda_equals_the_naive_loop_on_cuda(
    make_checkpoint: Callable[..., Checkpoint], make_engine: Callable[..., Engine]
) -> None:
    ck = make_checkpoint()
    ck.model.to("cuda")
    params = SamplingParams(max_new_tokens=40)
    prompt = [1, 2, 3, 4, 5]
    naive = [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]
    # past the window (5 + 40 > 32 tokens): a shift of 1 slides as the naive loop crops
    engine = make_engine(ck, device="cuda", dtype=torch.float32, max_batch_size=4, window_shift=1)
    assert engine.generate(prompt, params).token_ids == naive


def test_bf16_engine_serves_and_reproduces_seeds(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda", dtype=None, max_batch_size=4)
    assert engine.config.dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=30, do_sample=True, seed=7)
    a = engine.generate([1, 2, 3], params).token_ids
    b = engine.generate([1, 2, 3], params).token_ids
    assert a == b and len(a) == 30


def test_concurrent_requests_on_cuda_each_equal_the_naive_loop(
    make_checkpoint: Callable[..., Checkpoint], make_engine: Callable[..., Engine]
) -> None:
    """Continuous batching on the GPU: requests of different lengths sharing steps, each its own naive run."""
    ck = make_checkpoint(block_size=32)
    ck.model.to("cuda")
    engine = make_engine(ck, device="cuda", dtype=torch.float32, max_batch_size=4, window_shift=1)
    jobs = [([1 + i, 2, 3 + 2 * i][: 1 + i % 3] * (1 + i), SamplingParams(max_new_tokens=8 + 5 * i)) for i in range(6)]
    results = together(engine, jobs)
    for (prompt, params), got in zip(jobs, results, strict=True):
        want = [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]
        assert got.token_ids == want, prompt


def test_prefix_reuse_on_cuda_gives_the_cold_tokens(
    make_checkpoint: Callable[..., Checkpoint], make_engine: Callable[..., Engine]
) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, device="cuda", dtype=torch.float32)
    cold = make_engine(ck, device="cuda", dtype=torch.float32, prefix_cache=False)
    prompt, params = list(range(1, 21)), SamplingParams(max_new_tokens=10)
    want = cold.generate(prompt, params).token_ids
    assert engine.generate(prompt, params).token_ids == want
    assert engine.generate(prompt, params).token_ids == want
    assert engine.stats.cached_prompt_tokens_total == 19


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_quantized_weights_on_cuda_equal_the_naive_loop(
    make_checkpoint: Callable[..., Checkpoint], make_engine: Callable[..., Engine], kind: str
) -> None:
    """Stored int8 / bf16 weights on the GPU (torch's product with the dequantized weight): the engine's tokens are
    the naive loop's on the same quantized model."""
    ck = make_checkpoint()
    quantize(ck.model, kind)
    ck.model.to("cuda", dtype=torch.float32)
    params = SamplingParams(max_new_tokens=30)
    prompt = [4, 5, 6]
    naive = [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]
    engine = make_engine(ck, device="cuda", dtype=torch.float32, max_batch_size=2)
    assert engine.generate(prompt, params).token_ids == naive


def test_training_on_cuda_lowers_the_loss_and_the_checkpoint_serves_on_cpu(repo: Path, data_dir: Path,
                                                                          tmp_path: Path) -> None:
    """`python -m model.train --device cuda` (bf16 autocast where the GPU has it) for 40 steps, then the checkpoint
    loads on the CPU and its greedy tokens are the naive loop's."""
    text = data_dir / "tinyshakespeare" / "input.txt"
    if not text.is_file():
        pytest.skip(f"{text} not found (docs/tests.md; FOLIO_TEST_DATA)")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "model.train", "--preset", "shakespeare-char-cpu", "--data", str(text),
           "--out", str(out), "--device", "cuda", "--max-iters", "40", "--eval-interval", "20", "--eval-iters", "2",
           "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "64", "--batch-size", "16"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ck = load_checkpoint(out)
    training = ck.meta["training"]
    assert training["device"] == torch.cuda.get_device_name()
    assert training["val_loss"] < math.log(ck.tokenizer.n_vocab) - 0.5
    params = SamplingParams(max_new_tokens=20)
    prompt = ck.tokenizer.encode("ROMEO:")
    want = [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]
    engine = Engine(ck, device="cpu", threads=1).start()
    try:
        assert engine.generate(prompt, params).token_ids == want
    finally:
        engine.stop()


def test_cuda_graphs_are_captured_by_default_and_decode_as_eager_steps(make_engine: Callable[..., Engine]) -> None:
    """Decode steps replay CUDA graphs (one per rows and context bucket) unless `enforce_eager`; concurrent requests
    of different lengths, greedy and seeded, get the eager engine's tokens, and the steps went through the graphs."""
    kwargs = {"device": "cuda", "dtype": torch.float32, "max_batch_size": 6, "window_shift": 8}
    engine = make_engine(tiny_checkpoint(BLOCK), **kwargs)
    eager = make_engine(tiny_checkpoint(BLOCK), enforce_eager=True, **kwargs)
    assert eager.runner.graphs is None and eager.runner.cuda_graphs == "off (--enforce-eager)"
    graphs = engine.runner.graphs
    # rows 1, 2, 4, 6; contexts 64, 128, 160: every graph captured
    assert graphs is not None and len(graphs.graphs) == len(graphs) == 4 * 3, engine.runner.cuda_graphs
    assert engine.runner.cuda_graphs.startswith("12 captured")
    replays = []
    run = graphs.run
    graphs.run = lambda key, *args: replays.append(key) or run(key, *args)  # type: ignore[method-assign]
    for sampled in (False, True):
        work = graph_jobs(6, sampled)
        assert [r.token_ids for r in together(engine, work)] == [r.token_ids for r in together(eager, work)]
    assert {rows for rows, _ in replays} >= {1, 2, 4, 6} and {ctx for _, ctx in replays} == {64, 128, 160}


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_running_ahead_on_cuda_generates_what_a_step_at_a_time_generates(make_engine: Callable[..., Engine],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        eager: bool) -> None:
    """Async scheduling, on by default on CUDA: the next step's forward launched on the device's chosen tokens (their
    copy to the host not waited for first), through the captured graphs or eagerly, gives the tokens and
    log-probabilities of a step at a time, greedy, seeded, past the window, more requests than slots."""
    launches = []
    launch = ahead_module.launch
    monkeypatch.setattr(ahead_module, "launch", lambda *args: launches.append(1) or launch(*args))
    kwargs = {"device": "cuda", "dtype": torch.float32, "max_batch_size": 4, "window_shift": 8,
              "enforce_eager": eager}
    engine = make_engine(tiny_checkpoint(BLOCK), **kwargs)
    plain = make_engine(tiny_checkpoint(BLOCK), async_scheduling=False, **kwargs)
    assert engine.config.async_scheduling and (engine.runner.graphs is None) == eager
    for sampled in (False, True):
        work = graph_jobs(6, sampled)
        got, want = together(engine, work), together(plain, work)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for g, w in zip(got, want):
            assert [t.logprob for t in g.tokens] == pytest.approx([t.logprob for t in w.tokens], abs=1e-4)
    assert len(launches) > 50


def test_a_drawn_token_inverts_the_cumulative_distribution_on_cuda() -> None:
    """`draw` on the device, without waiting for it: each row's id is where its generator's uniform number falls in
    its cumulative distribution (computed here on the host), alone or among other rows."""
    probs = torch.softmax(torch.randn(8, 5000, device="cuda") * 3, -1)
    together = draw(probs, uniforms([new_generator(seed) for seed in range(8)])).tolist()
    for seed in range(8):
        assert int(draw(probs[seed], uniforms([new_generator(seed)]))) == together[seed]
        assert together[seed] == inverse_cdf(probs[seed].cpu(), seed)


def test_constrained_requests_decode_on_cuda(make_engine: Callable[..., Engine]) -> None:
    """Structured output on the GPU: the step's masks, made on the host, reach the device's logits; sampled outputs
    match their regex whole, and a constrained row beside unconstrained ones leaves their tokens as they are alone
    (greedy)."""
    ck = tiny_checkpoint(block_size=64)
    engine = make_engine(ck, device="cuda", max_batch_size=4)
    pattern = "[a-z]{2,5}( [a-z]{2,5}){1,3}[.!?]"
    constraint = ConstraintCompiler().compile(ConstraintSpec.regex(pattern), ck.tokenizer)
    constrained = [SamplingParams(max_new_tokens=60, do_sample=True, temperature=1.0, seed=s, constraint=constraint)
                   for s in range(3)]
    free = SamplingParams(max_new_tokens=20)
    prompt = ck.tokenizer.encode("ab")
    results = together(engine, [(prompt, p) for p in [*constrained, free]])
    for r in results[:3]:
        assert re.fullmatch(pattern, r.finished.generated_text), r.finished.generated_text
    assert results[3].token_ids == engine.generate(prompt, free).token_ids


def test_steps_2_to_6_on_cuda_equal_the_cpus() -> None:
    """Logit bias, min_tokens, the penalties and a constraint applied on the device to a batch of rows, each step one
    indexed operation (the masks and ids made on the host): the CPU's logits exactly (float32 adds, multiplies and
    divides round alike)."""
    logits, rows = edited_rows(40)
    edits = [sampler_module.row_edits(r, 39, 40) for r in rows]
    on_cpu, on_cuda = logits.clone(), logits.cuda()
    for x in (on_cpu, on_cuda):
        sampler_module.penalise(x, edits, 39)
        sampler_module._constrain(x, rows)
    assert torch.equal(on_cuda.cpu(), on_cpu)


@pytest.mark.slow
def test_a_compiled_decode_step_replays_the_eager_tokens(make_engine: Callable[..., Engine]) -> None:
    """`compile=True`: the step compiled (torch.compile) before its graphs are captured; the same tokens."""
    kwargs = {"device": "cuda", "dtype": torch.float32, "max_batch_size": 4, "window_shift": 8}
    engine = make_engine(tiny_checkpoint(BLOCK), compile=True, **kwargs)
    assert engine.runner.cuda_graphs.endswith("the step compiled"), engine.runner.cuda_graphs
    eager = make_engine(tiny_checkpoint(BLOCK), enforce_eager=True, **kwargs)
    work = graph_jobs(4)
    assert [r.token_ids for r in together(engine, work)] == [r.token_ids for r in together(eager, work)]


def test_capturing_graphs_beside_a_decoding_engine_breaks_neither(make_engine: Callable[..., Engine]) -> None:
    """Several models on one GPU: a model loading (its graphs captured) while another decodes. The capture is
    thread-local, so the serving engine's waits and allocations meanwhile do not fail its steps."""
    kwargs = {"device": "cuda", "dtype": torch.float32, "window_shift": 8}
    serving = make_engine(tiny_checkpoint(BLOCK), max_batch_size=2, **kwargs)
    params = SamplingParams(max_new_tokens=600, stop_at_eos=False)
    want = make_engine(tiny_checkpoint(BLOCK), max_batch_size=2, enforce_eager=True, **kwargs).generate([1, 2], params)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(serving.generate([1, 2], params)))
    worker.start()
    loading = [make_engine(tiny_checkpoint(BLOCK), max_batch_size=8, **kwargs) for _ in range(3)]
    worker.join(timeout=120)
    assert got and got[0].token_ids == want.token_ids
    assert all(e.runner.graphs is not None for e in loading), [e.runner.cuda_graphs for e in loading]


def test_no_garbage_collection_inside_a_capture() -> None:
    """The garbage collector is off while graphs are captured (what it frees there, another engine's graphs say,
    fails the capture: seen on an H200 when a benchmark built engines one after another), on again after."""
    from model.engine.graphs import DecodeGraphs

    seen: list[tuple[bool, bool]] = []  # (capturing, collector on), each time the step ran

    def step(ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, context: int) -> torch.Tensor:
        seen.append((torch.cuda.is_current_stream_capturing(), gc.isenabled()))
        return (ids + positions).float().expand(-1, 4) * context

    graphs = DecodeGraphs(step, max_rows=2, block_size=64, scratch_row=2, device=torch.device("cuda"), capture=True)
    assert len(graphs.graphs) == 2 and gc.isenabled()
    # each shape warmed with the collector on (--compile's compiles happen there), then captured with it off
    assert seen == [(False, True)] * 2 + [(True, False)] * 2
    torch.testing.assert_close(graphs.run((2, 64), [0, 1], [5, 6], [1, 2]).cpu(),
                               torch.tensor([[6.0] * 4, [8.0] * 4]) * 64)
    graphs.close()
    assert not graphs.graphs
