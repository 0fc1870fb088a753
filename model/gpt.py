"""The GPT-2 architecture (after nanoGPT), with a preallocated KV cache for incremental decoding.

Parameter names and layouts are nanoGPT's, so nanoGPT and (transposed) GPT-2 weights map one to one.
`GPT.forward` maps token ids to logits and does nothing else: no loss, no sampling, no text.

Incremental decoding: a `KVCache` holds keys and values for `batch_size` rows. Cache slot `p` of a row holds
the token at position `p`, so rows may sit at different positions; a query at position `p` attends to slots
`0..p` of its own row. Slots above a row's position may hold stale values and are always masked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from model import kernels
from model.config import GPTConfig


class KVCache:
    """Keys and values for every layer, preallocated: (n_layer, batch, n_head, max_len, head_size)."""

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int,
        *,
        max_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.max_len = max_len or config.block_size
        if self.max_len > config.block_size:
            raise ValueError(f"max_len {self.max_len} exceeds block_size {config.block_size}")
        shape = (config.n_layer, batch_size, config.n_head, self.max_len, config.head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # each layer's view, made once (indexing per layer per step is a tensor op each time)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


@dataclass(frozen=True)
class CacheStep:
    """What every layer needs for one cached forward, computed once per forward."""

    cache: KVCache
    rows: torch.Tensor | slice  # cache rows of the batch rows
    row_idx: torch.Tensor  # (B, 1) the same rows as an index
    pos: torch.Tensor  # (B, T) positions of the new tokens
    kv_len: int  # cache slots read
    mask: torch.Tensor | None  # (B, 1, T, kv_len): a query at position p sees slots 0..p of its own row
    fused: bool  # each block through `kernels.decode_block`, the B * T tokens as rows (no mask needed)
    token_rows: torch.Tensor | None = None  # fused: (B * T,) each token's cache row
    token_pos: torch.Tensor | None = None  # fused: (B * T,) each token's position


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's cannot drop only the bias)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Linear(nn.Linear):
    """nn.Linear (same parameters), computed by `kernels.linear`: at inference on CPU a few rows go through a
    kernel that reads the weights at memory bandwidth; everything else is `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, step: CacheStep | None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        if step is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            k_cache, v_cache = step.cache.k[self.layer], step.cache.v[self.layer]
            # write this step's keys/values at each token's own position: cache[b, :, pos[b, t]]
            k_cache[step.row_idx, :, step.pos] = k.transpose(1, 2).to(k_cache.dtype)
            v_cache[step.row_idx, :, step.pos] = v.transpose(1, 2).to(v_cache.dtype)
            keys = k_cache[step.rows, :, : step.kv_len]  # (B, nh, kv_len, hs)
            values = v_cache[step.rows, :, : step.kv_len]
            y = F.scaled_dot_product_attention(
                q, keys.to(q.dtype), values.to(q.dtype), attn_mask=step.mask, dropout_p=dropout_p
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, step: CacheStep | None) -> torch.Tensor:
        if step is not None and step.fused:  # the same maths in one kernel call (model/kernels.py)
            B, T, C = x.size()
            cache, layer = step.cache, self.attn.layer
            y = kernels.decode_block(x.reshape(B * T, C), self, cache.k_layers[layer], cache.v_layers[layer],
                                     step.token_rows, step.token_pos, self.attn.n_head)
            return y.view(B, T, C)
        x = x + self.attn(self.ln_1(x), step)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        if self.transformer.wte.weight.device.type != "meta":
            self.apply(self._init_weights)
            # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (the LM head shares `wte`); without position embeddings if asked."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        *,
        pos: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
        kv_len: int | None = None,
        last_only: bool = False,
        take: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size), or (B, 1, vocab_size) with `last_only` (the last position)
        or `take` ((B,): for each row, the index in T of the one position whose logits are wanted).

        Without `kv_cache` this is the plain causal forward over positions 0..T-1 (training, the naive
        reference). With it, `pos` (B, T) gives each token's position (defaults to 0..T-1), the new keys and
        values are written to the cache at those positions, and each query attends to its row's slots up to
        its own position. `rows` picks cache rows for the batch rows (default: rows 0..B-1); `kv_len` bounds
        the slots read (default: max(pos) + 1; pass it to avoid a device sync).
        """
        B, T = idx.size()
        if pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
            pos = torch.arange(T, device=idx.device).expand(B, T)
        elif pos.shape != idx.shape:
            raise ValueError(f"pos shape {tuple(pos.shape)} must equal idx shape {tuple(idx.shape)}")
        step = None
        if kv_cache is not None:
            kv_len = int(pos.max()) + 1 if kv_len is None else kv_len
            row_idx = torch.arange(B, device=idx.device) if rows is None else rows
            # decode steps and short prompt chunks go through the fused blocks, every token a row of the kernels;
            # longer chunks through torch's SDPA (its attention is faster for many queries at once)
            fused = B * T <= kernels.FUSED_MAX_TOKENS and not self.training and kernels.decode_block_applies(
                self.lm_head.weight, kv_cache.k, self.config.head_size)
            step = CacheStep(
                cache=kv_cache,
                rows=slice(0, B) if rows is None else rows,
                row_idx=row_idx[:, None],
                pos=pos,
                kv_len=kv_len,
                mask=None if fused else torch.arange(kv_len, device=idx.device) <= pos[:, None, :, None],
                fused=fused,
                token_rows=row_idx.repeat_interleave(T) if fused else None,
                token_pos=pos.reshape(-1) if fused else None,
            )
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, step)
        if last_only:
            x = x[:, -1:, :]
        elif take is not None:
            x = x[torch.arange(B, device=x.device), take][:, None, :]
        x = self.transformer.ln_f(x)
        return self.lm_head(x)
