"""The KV cache's element type (`--kv-cache-dtype`): the "auto" rule, and what an fp16 cache costs in quality,
measured through the engine's own decode steps against an fp32 cache."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from model import kernels
from model.checkpoint import load_checkpoint
from model.engine import EngineConfig
from model.engine.runner import ModelRunner, resolve_kv_cache_dtype
from model.quantize import quantize
from model.sampling_params import SamplingParams


def test_auto_is_fp16_for_quantized_weights_computed_in_fp32_else_the_models_dtype(make_checkpoint) -> None:
    model = make_checkpoint().model
    assert resolve_kv_cache_dtype("auto", model, torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", model, torch.bfloat16) == torch.bfloat16  # a GPU's half-precision model
    assert resolve_kv_cache_dtype("fp16", model, torch.float32) == torch.float16
    int8 = copy.deepcopy(model)
    quantize(int8, "int8")
    assert resolve_kv_cache_dtype("auto", int8, torch.float32) == torch.float16
    assert resolve_kv_cache_dtype("fp32", int8, torch.float32) == torch.float32
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp32, fp16; got 'int4'"):
        resolve_kv_cache_dtype("int4", model, torch.float32)


@pytest.mark.parametrize("choice, want", [("auto", torch.float32), ("fp16", torch.float16)])
def test_an_engine_keeps_its_cache_in_the_chosen_type(make_engine, choice: str, want: torch.dtype) -> None:
    engine = make_engine(kv_cache_dtype=choice)
    cache = engine.runner.cache
    assert engine.runner.kv_dtype == cache.k.dtype == cache.v.dtype == want
    assert engine.runner.kv_cache_bytes == 2 * cache.k.numel() * want.itemsize
    result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5, greedy=True))
    assert len(result.token_ids) == 5 and bool(cache.k[:, 0, :, :7].abs().sum() > 0)  # written where it was read


def decode_nll(runner: ModelRunner, ids: list[int], block: int) -> tuple[float, torch.Tensor]:
    """Mean next-token NLL of `ids` fed one token a step through the runner's decode (teacher forcing, a fresh
    window every `block` tokens), and every step's log-probabilities."""
    total, logps = 0.0, []
    with torch.inference_mode(), runner.decode_context():
        for start in range(0, len(ids) - 1, block):
            chunk = ids[start:start + block]
            steps = [runner.decode([0], [t], [i])[0] for i, t in enumerate(chunk[:-1])]
            lp = torch.stack(steps).float().log_softmax(-1)
            total -= float(lp[torch.arange(len(chunk) - 1), torch.tensor(chunk[1:])].sum())
            logps.append(lp)
    return total / (len(ids) - 1), torch.cat(logps)


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_an_fp16_cache_keeps_the_bundled_models_loss_as_decoded(repo, data_dir, kind: str) -> None:
    """4,000 validation characters of tiny Shakespeare decoded one token a step (every key and value read back from
    the cache) with an fp16 cache and an fp32 one, with fp32 and int8 weights: loss within 0.1%, the same top-1
    token at 99% of the steps or more."""
    text = data_dir / "tinyshakespeare" / "input.txt"
    if not text.is_file():
        pytest.skip(f"{text} not found (docs/tests.md; FOLIO_TEST_DATA)")
    ck = load_checkpoint(repo / "weights" / "shakespeare-char")
    if kind != "none":
        quantize(ck.model, kind)
    raw = text.read_text(encoding="utf-8")
    ids = ck.tokenizer.encode(raw[int(len(raw) * 0.9):][:4000])
    kernels.load()
    out = {}
    for choice in ("fp32", "fp16"):
        runner = ModelRunner(ck, EngineConfig(max_batch_size=1, device="cpu", threads=1, kv_cache_dtype=choice))
        runner.on_engine_thread()
        out[choice] = decode_nll(runner, ids, ck.config.block_size)
    (nll32, lp32), (nll16, lp16) = out["fp32"], out["fp16"]
    top1 = float((lp32.argmax(-1) == lp16.argmax(-1)).float().mean())
    kl = float((lp32.exp() * (lp32 - lp16)).sum(-1).mean())
    print(f"\n{kind} weights, decoded: loss fp32 cache {nll32:.4f}, fp16 cache {nll16:.4f} (x{nll16 / nll32:.5f}), "
          f"KL {kl:.1e}, top-1 agreement {top1:.4f}")
    assert math.isfinite(nll16) and abs(nll16 / nll32 - 1) < 1e-3 and top1 >= 0.99
