"""What the model tests check the inspector and streamed attention against: the attention weights written out
independently of the model's modules (F.linear, layer norm, softmax), not through `model.gpt`'s blocks or hooks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from model.gpt import GPT, stored_as


def reference_attention(model: GPT, ids: list[int], layer: int,
                        product: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                        kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An independent reference for tests: the layer's attention weights (n_head, T, T) from a plain forward
    written out with F.linear and softmax(q k^T / sqrt(d)), no hooks. `product(linear, x)` applies a block's linear
    layer where F.linear of its weight and bias would not (a quantized product as the kernels compute it); keys and
    values are rounded to `kv_dtype` as a cache of that type stores them."""
    cfg, tr = model.config, model.transformer
    product = product or (lambda linear, x: F.linear(x, linear.weight, linear.bias))
    with torch.inference_mode():
        x = tr.wte(torch.tensor([ids])) + tr.wpe(torch.arange(len(ids)))
        for n, block in enumerate(tr.h):
            h = F.layer_norm(x, (cfg.n_embd,), block.ln_1.weight, block.ln_1.bias, 1e-5)
            qkv = product(block.attn.c_attn, h)
            q, k, v = (t.view(1, len(ids), cfg.n_head, cfg.head_size).transpose(1, 2)
                       for t in qkv.split(cfg.n_embd, dim=2))
            k, v = stored_as(k, kv_dtype).float(), stored_as(v, kv_dtype).float()
            att = (q @ k.transpose(-2, -1)) / math.sqrt(cfg.head_size)
            att = att.masked_fill(~torch.ones(len(ids), len(ids), dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            if n == layer:
                return att[0]
            y = (att @ v).transpose(1, 2).reshape(1, len(ids), cfg.n_embd)
            x = x + product(block.attn.c_proj, y)
            h = F.layer_norm(x, (cfg.n_embd,), block.ln_2.weight, block.ln_2.bias, 1e-5)
            h = F.gelu(product(block.mlp.c_fc, h), approximate="tanh")
            x = x + product(block.mlp.c_proj, h)
    raise ValueError(f"layer {layer} is not in [0, {cfg.n_layer})")
