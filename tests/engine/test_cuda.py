"""The engine on a CUDA device (bf16 by default there): skipped, with the reason, on machines without one."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_checkpoint

from app.engine import Engine
from model.generate import generate_naive
from model.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine"),
]


def test_fp32_greedy_on_cuda_equals_the_naive_loop_on_cuda() -> None:
    ck = tiny_checkpoint()
    ck.model.to("cuda")
    params = SamplingParams(max_new_tokens=40)
    prompt = [1, 2, 3, 4, 5]
    naive = [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]
    engine = Engine(ck, device="cuda", dtype=torch.float32, max_batch_size=4).start()
    try:
        assert engine.generate(prompt, params).token_ids == naive
    finally:
        engine.stop()


def test_bf16_engine_serves_and_reproduces_seeds() -> None:
    engine = Engine(tiny_checkpoint(), device="cuda", max_batch_size=4).start()
    try:
        assert engine.dtype == torch.bfloat16
        params = SamplingParams(max_new_tokens=30, do_sample=True, seed=7)
        a = engine.generate([1, 2, 3], params).token_ids
        b = engine.generate([1, 2, 3], params).token_ids
        assert a == b and len(a) == 30
    finally:
        engine.stop()
