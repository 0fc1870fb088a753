"""The engine on a CUDA device (bf16 by default there): skipped, with the reason, on machines without one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model.checkpoint import Checkpoint
from model.engine import Engine
from model.reference import generate_naive
from model.sampling_params import SamplingParams

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
    engine = make_engine(ck, device="cuda", dtype=torch.float32, max_batch_size=4)
    assert engine.generate(prompt, params).token_ids == naive


def test_bf16_engine_serves_and_reproduces_seeds(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda", dtype=None, max_batch_size=4)
    assert engine.dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=30, do_sample=True, seed=7)
    a = engine.generate([1, 2, 3], params).token_ids
    b = engine.generate([1, 2, 3], params).token_ids
    assert a == b and len(a) == 30
