"""The GPT-2 architecture (after nanoGPT), with a preallocated KV cache for incremental decoding.

Parameter names and layouts are nanoGPT's, so nanoGPT and (transposed) GPT-2 weights map one to one.
`GPT.forward(idx, cache, take)` maps token ids to logits and does nothing else: no loss, no sampling, no text.

Incremental decoding: a `KVCache` holds keys and values for `batch_size` rows. Cache slot `p` of a row holds
the token at position `p`, so rows may sit at different positions; a query at position `p` attends to slots
`0..p` of its own row. Slots above a row's position may hold stale values and are always masked out. A cached
forward is given a `CacheStep` (`KVCache.step`: its tokens' positions and cache rows, as gpt-fast's `input_pos`),
whose `update` writes a layer's new keys and values and returns what its queries attend to; a step made with
`write=False` only reads (streamed attention recomputes a token the decode step already wrote).

Everything here is plain torch. The CPU decode kernels enter by swapping modules (`model.kernels.install`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.config import GPTConfig
from model.hugepages import zeros_on_huge_pages

# Cached attention (a mask, and keys that grow by one every step) never goes to cuDNN's backend: it builds a plan
# for every new shape, which made decoding on an H200 4.3x slower (bench/engine_decode.py --device cuda)
CACHED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


FP16_MAX = torch.finfo(torch.float16).max


class cached_property:  # noqa: N801 - functools' name and behaviour
    """functools.cached_property without the lock Python 3.11's takes (removed in 3.12), which torch.compile cannot
    trace: a decode step compiled for CUDA graphs (model/engine/graphs.py) reads a `CacheStep`'s cached tensors."""

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func, self.name = func, func.__name__
        self.__doc__ = func.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


def stored_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it: fp16 saturates at +-65504 (a key beyond is stored as the largest half,
    not as an infinity that would turn its row's attention into NaN) and rounds to nearest even, as the kernels'
    F16C conversion does; NaN stays NaN."""
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = x.clamp(-FP16_MAX, FP16_MAX)
    return x.to(dtype)


class KVCache:
    """Keys and values for every layer, preallocated: (n_layer, batch, n_head, max_len, head_size), stored in
    `dtype` (fp16 halves the bytes each decode step's attention reads; `stored_as`) and widened to the queries'
    dtype where they are read."""

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
        if torch.device(device).type == "cpu":  # attention's scattered reads: huge pages spare TLB misses
            self.k, self.v = zeros_on_huge_pages(shape, dtype), zeros_on_huge_pages(shape, dtype)
        else:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        # each layer's view, made once (indexing per layer per step is a tensor op each time)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def step(self, pos: torch.Tensor, rows: torch.Tensor | None = None, kv_len: int | None = None, *,
             write: bool = True) -> CacheStep:
        """One cached forward's place in the cache: new token (b, t) at position `pos[b, t]` (B, T) of cache row
        `rows[b]` (default: rows 0..B-1); `kv_len` bounds the slots read (default max(pos) + 1). With `write=False`
        the forward writes nothing: its queries attend to the keys and values already in those slots."""
        return CacheStep(self, pos, rows, kv_len, write)


class CacheStep:
    """A `KVCache` as one cached forward sees it. Each layer's attention calls `update`; what the layers share
    (the mask, the tokens' rows and positions) is computed once, on first use."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, rows: torch.Tensor | None, kv_len: int | None,
                 write: bool = True) -> None:
        self.cache, self.pos, self.rows, self.write = cache, pos, rows, write
        self._kv_len = kv_len

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values for every cache row: (rows, n_head, max_len, head_size) each."""
        return self.cache.k_layers[i], self.cache.v_layers[i]

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer i's new keys and values (B, nh, T, hs) at each token's own position, cache[row, :, pos];
        return the keys and values its queries attend to, (B, nh, kv_len, hs), through `mask` (a read-only step
        writes nothing and returns what the slots hold)."""
        if self.write:
            k_cache, v_cache = self.layer(i)
            k_cache[self._write_rows, :, self.pos] = stored_as(k.transpose(1, 2), k_cache.dtype)
            v_cache[self._write_rows, :, self.pos] = stored_as(v.transpose(1, 2), v_cache.dtype)
        return self.read(i)

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values that this step's queries attend to, (B, nh, kv_len, hs) each, as stored."""
        k_cache, v_cache = self.layer(i)
        # rows 0..B-1 in order read as a slice: a view, not a gather
        rows = slice(0, self.pos.shape[0]) if self.rows is None else self.rows
        return k_cache[rows, :, : self.kv_len], v_cache[rows, :, : self.kv_len]

    @cached_property
    def kv_len(self) -> int:
        """Cache slots read (reading max(pos) waits for the device: the caller may pass it)."""
        return int(self.pos.max()) + 1 if self._kv_len is None else self._kv_len

    @cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, kv_len): a query at position p sees slots 0..p of its own row."""
        return torch.arange(self.kv_len, device=self.pos.device) <= self.pos[:, None, :, None]

    @cached_property
    def token_rows(self) -> torch.Tensor:
        """(B * T,) each new token's cache row, the tokens of all rows as one list."""
        T = self.pos.shape[1]
        return self._row_index if T == 1 else self._row_index.repeat_interleave(T)

    @cached_property
    def token_pos(self) -> torch.Tensor:
        """(B * T,) each new token's position, in `token_rows`' order."""
        return self.pos.reshape(-1)

    @cached_property
    def _row_index(self) -> torch.Tensor:
        return torch.arange(self.pos.shape[0], device=self.pos.device) if self.rows is None else self.rows

    @cached_property
    def _write_rows(self) -> torch.Tensor:
        return self._row_index[:, None]


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's cannot drop only the bias)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: CacheStep | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            keys, values = cache.update(self.layer, k, v)  # (B, nh, kv_len, hs)
            with sdpa_kernel(CACHED_SDPA_BACKENDS):
                y = F.scaled_dot_product_attention(
                    q, keys.to(q.dtype), values.to(q.dtype), attn_mask=cache.mask, dropout_p=dropout_p
                )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
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

    def forward(self, x: torch.Tensor, cache: CacheStep | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class Blocks(nn.ModuleList):
    """The transformer's blocks, run in order (one module, so that `model/kernels` can run them all in one call)."""

    def forward(self, x: torch.Tensor, cache: CacheStep | None = None) -> torch.Tensor:
        for block in self:
            x = block(x, cache)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=Blocks([Block(config, i) for i in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
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

    def forward(self, idx: torch.Tensor, cache: CacheStep | None = None, take: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size), or (B, 1, vocab_size) with `take`: (B,) for each row the
        index in T of the one position whose logits are wanted (-1: the last).

        Without `cache` this is the plain causal forward over positions 0..T-1 (training, the naive reference).
        With it (`KVCache.step`: each token's position and cache row), the new keys and values are written to the
        cache at those positions and each query attends to its row's slots up to its own position.
        """
        B, T = idx.size()
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
            pos = torch.arange(T, device=idx.device).expand(B, T)
        elif cache.pos.shape != idx.shape:
            raise ValueError(f"the cache step's positions {tuple(cache.pos.shape)} must match idx {tuple(idx.shape)}")
        else:
            pos = cache.pos
        x = self.transformer.h(self.embed(idx, pos), cache)
        if take is not None:
            x = x[torch.arange(B, device=x.device), take][:, None, :]  # (B, 1, C)
        return self.logits(x)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The residual stream before the blocks: token ids (B, T) at positions `pos` (B, T) or (T,) -> (B, T, C)."""
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream (..., C) through the final LayerNorm and the LM head: (..., vocab_size)."""
        return self.lm_head(self.transformer.ln_f(x))
