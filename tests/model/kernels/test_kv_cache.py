"""The fp16 KV cache as the kernels write it: the same bits as torch's rounding (`model.gpt.stored_as`)."""

from __future__ import annotations

import torch

from model import kernels
from model.gpt import stored_as


def test_an_fp16_cache_stores_keys_and_values_as_torch_rounds_them(built: None) -> None:
    """The kernels' writes into an fp16 cache: rounded to nearest even (ties included), subnormals kept, values
    beyond fp16's range saturated at +-65504 (not infinities that would make the row's attention NaN), NaN kept:
    bit for bit `stored_as`, i.e. torch's clamp and `.half()`; the fp32 cache stores the values themselves."""
    n_head, hs = 2, 8
    C = n_head * hs
    special = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 3e-6, -2e-7, 65519.0, 65520.0, 1e9, -1e9, float("nan"),
                            float("inf"), float("-inf"), 0.1, -0.0, 2.5, 65504.0, -70000.0])
    qkv = torch.randn(3, 3 * C)
    qkv[0, C:3 * C] = torch.cat([special, -special])
    rows, pos = torch.tensor([1, 0, 1]), torch.tensor([0, 4, 1])
    for kv in (torch.float16, torch.float32):
        k, v = torch.zeros(2, n_head, 8, hs, dtype=kv), torch.zeros(2, n_head, 8, hs, dtype=kv)
        kernels.decode_attention(qkv, k, v, rows, pos, n_head)
        for b in range(3):
            for cache, part in ((k, qkv[b, C:2 * C]), (v, qkv[b, 2 * C:])):
                written = cache[rows[b], :, pos[b]].reshape(-1)
                want = stored_as(part, kv)
                assert torch.equal(written.view(torch.int16 if kv == torch.float16 else torch.int32),
                                   want.view(torch.int16 if kv == torch.float16 else torch.int32))
    assert stored_as(special, torch.float16)[4:8].tolist() == [65504.0, 65504.0, 65504.0, -65504.0]
