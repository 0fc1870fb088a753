"""Streamed attention: for a request that asks (`SamplingParams.attention`), the attention with which the model
chose each generated token, sent with the token.

Which weights: the token was chosen from the logits of the last token fed (the one before it), so its attention
is that query's softmax(q k^T / sqrt(head_size)) over every position in the row's cache: the tokens before the
new one (within the window, after a slide). The same row as `model.inspection` gives, for the text so far, at the
position before the token.

How: the decode step's kernels do not hand out their weights, and capturing them inside the step would change
the step. So after the step, the model's own blocks run that one token per watching row again on a read-only cache
step (`KVCache.step(..., write=False)`), and `model.inspection.block_attention` captures each layer's query, as the
inspector does, against the keys and values the step itself wrote into the cache. It writes nothing (the cache, the
tokens and every other row are untouched) and costs one token's forward per watching row, up to the last layer
asked for.
"""

from __future__ import annotations

import torch

from model.config import GPTConfig
from model.engine.events import TokenAttention
from model.engine.request import Request
from model.gpt import GPT, KVCache
from model.inspection import block_attention
from model.sampling_params import AttentionSpec, ValidationError

MAX_TOKEN_WEIGHTS = 16_384  # weights sent with one token, at most: layers x (heads, or 1 for the mean) x context
MAX_REQUEST_WEIGHTS = 4_194_304  # and with all of a request's tokens: that times max_new_tokens
DECIMALS = 6  # weights are sent rounded to 6 decimals (an error of at most 5e-7)


def check_spec(spec: AttentionSpec, config: GPTConfig, max_new_tokens: int) -> None:
    """`ValidationError` (field `attention...`) for layers or heads the model lacks, or more weights than the
    limits allow (counted for a full context: a token attends to at most `block_size` positions)."""
    for name, values, limit in (("attention.layers", spec.layers, config.n_layer),
                                ("attention.heads", spec.heads, config.n_head)):
        if values is None:
            continue
        bad = [v for v in values if not 0 <= v < limit]
        if not values or bad or len(set(values)) != len(values):
            raise ValidationError(name, f"must list distinct integers in [0, {limit - 1}] (or be left out), got "
                                        f"{list(values)[:8]}")
    rows = len(spec.layers or range(config.n_layer)) * (len(spec.heads) if spec.heads else 1)
    per_token = rows * config.block_size
    if per_token > MAX_TOKEN_WEIGHTS:
        raise ValidationError("attention", f"layers x heads x context is {per_token} weights per token, more than "
                                           f"{MAX_TOKEN_WEIGHTS}: choose fewer layers or heads (no heads: their mean)")
    if per_token * max_new_tokens > MAX_REQUEST_WEIGHTS:
        raise ValidationError("attention", f"layers x heads x context x max_new_tokens is {per_token * max_new_tokens}"
                                           f" weights, more than {MAX_REQUEST_WEIGHTS}: choose fewer layers or heads, "
                                           "or fewer new tokens")


def watch(model: GPT, cache: KVCache, reqs: list[Request]) -> dict[int, TokenAttention | Exception]:
    """`capture` for those of `reqs` that ask for their attention; for each of them the exception instead, should
    it fail (the scheduler fails those requests alone)."""
    watching = [req for req in reqs if req.params.attention is not None]
    try:
        return capture(model, cache, watching) if watching else {}  # type: ignore[return-value]
    except Exception as e:
        return {req.id: e for req in watching}


def capture(model: GPT, cache: KVCache, reqs: list[Request]) -> dict[int, TokenAttention]:
    """The attention of each request's last fed token (`context[-1]` at `pos - 1` of its cache row), by request
    id, as its `AttentionSpec` asks; call after the step that fed it and before the next one writes the cache."""
    specs = [req.params.attention for req in reqs]
    assert all(spec is not None for spec in specs)
    n_layer = model.config.n_layer
    deepest = max(max(spec.layers) if spec.layers else n_layer - 1 for spec in specs)  # type: ignore[union-attr]
    weights = _last_token_attention(model, cache, [r.row for r in reqs], [r.context[-1] for r in reqs],
                                    [r.pos - 1 for r in reqs], deepest)
    out = {}
    for i, (req, spec) in enumerate(zip(reqs, specs)):
        assert spec is not None
        layers = spec.layers if spec.layers is not None else tuple(range(n_layer))
        picked = weights[i, list(layers), :, : req.pos]  # (layers, n_head, keys)
        picked = picked[:, list(spec.heads)] if spec.heads else picked.mean(1, keepdim=True)
        rows = picked.reshape(-1, req.pos).double().round(decimals=DECIMALS).tolist()
        start = len(req.prompt) + len(req.output) - req.pos  # the index of key 0 among the tokens so far
        out[req.id] = TokenAttention(start=start, layers=layers, heads=spec.heads, weights=rows)
    return out


def _last_token_attention(model: GPT, cache: KVCache, rows: list[int], tokens: list[int], positions: list[int],
                          deepest: int) -> torch.Tensor:
    """(n, deepest + 1, n_head, max(positions) + 1): each token's attention weights in layers 0..deepest over the
    slots 0..its position of its cache row (zero beyond), in float32: the model's own blocks on a read-only cache
    step, their attention captured as the inspector captures it (`block_attention`). Writes nothing."""
    device = cache.k.device
    pos = torch.tensor(positions, device=device)[:, None]  # (n, 1)
    step = cache.step(pos, torch.tensor(rows, device=device), write=False)
    x = model.embed(torch.tensor(tokens, device=device)[:, None], pos)  # (n, 1, C)
    out = []
    for _, block in zip(range(deepest + 1), model.transformer.h):
        x, weights = block_attention(block, x, step)  # weights (n, n_head, 1, kv_len)
        out.append(weights[:, :, 0])
    return torch.stack(out, 1)
