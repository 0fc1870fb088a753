"""The model side of the engine: the model on its device, the KV cache, and the two kinds of forward a step
makes (prompt chunks into their rows; one token for every running row). Ids and positions in, logits out; which
tokens each row holds is the batch's to record (model/engine/batch.py)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from model import kernels
from model.checkpoint import WEIGHTS_FILE, Checkpoint, read_config
from model.config import GPTConfig
from model.devices import default_dtype, resolve_device, to_device
from model.engine.config import NGRAM, EngineConfig
from model.engine.graphs import DecodeGraphs
from model.gpt import KVCache
from model.kernels.modules import StoredLinear
from model.lora import batched as lora
from model.malloc import keep_freed_memory

log = logging.getLogger("folio.engine")

# what `--kv-cache-dtype` names: the cache's element type ("auto": `resolve_kv_cache_dtype`'s rule)
KV_CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

# a CPU thread pays off from about this many parameters a model has: below, handing a small product's pieces to a
# second thread costs more than it saves (bench/threads.py measures it: bench/results/threads.json)
PARAMS_PER_THREAD = 8_000_000


def default_threads(n_params: int, cores: int | None = None) -> int:
    """Threads for a model of `n_params` parameters on `cores` cores (default: this machine's): one per
    PARAMS_PER_THREAD parameters, at least 1, at most the cores."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(cores, n_params // PARAMS_PER_THREAD))


def resolve_kv_cache_dtype(choice: str, model: torch.nn.Module | bool, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for `choice` ("auto", or a key of KV_CACHE_DTYPES) and a model computing in
    `dtype`. "auto" is the model's dtype, except fp16 where its weights are quantized (int8, bf16) and it computes in
    fp32 on CPU: those weights already trade a measured sliver of quality for speed, and a decode step of many rows
    reads as many cache bytes as weight bytes (32 rows of GPT-2 small at position 64: 113 MB of fp32 keys and
    values, 125 MB of int8 weights). llama.cpp keeps its cache in f16 by default too. `model`: the model, or
    whether its weights are quantized (before it is built)."""
    if choice != "auto":
        if choice not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {choice!r}")
        return KV_CACHE_DTYPES[choice]
    quantized = model if isinstance(model, bool) else any(isinstance(m, StoredLinear) for m in model.modules())
    return torch.float16 if quantized and dtype == torch.float32 else dtype


def memory_needed(config: GPTConfig, weights_bytes: int, engine: EngineConfig, *, quantized: bool = False) -> int:
    """About the bytes a `ModelRunner` built with `engine` takes for a checkpoint of `config` whose weights file holds
    `weights_bytes` bytes, before it is loaded: its weights (the file's bytes, or more where they are widened to
    the engine's dtype; an fp32 checkpoint quantized at load holds its fp32 weights while it quantizes), their packed
    copy where the CPU kernels run them (at most as much again: the products' weights), and its KV cache (exactly,
    a row per batch slot); with a draft model (`engine.speculative_model` a checkpoint directory), the draft's as
    well. A reload checks it against the memory left beside the engine that serves (model/registry.py)."""
    device = resolve_device(engine.device)
    dtype = engine.dtype or default_dtype(device)
    weights = weights_bytes if quantized else max(weights_bytes, config.num_params() * dtype.itemsize)
    packed = weights if device.type == "cpu" and dtype == torch.float32 and kernels.library() is not None else 0
    kv = resolve_kv_cache_dtype(engine.kv_cache_dtype, quantized, dtype).itemsize
    rows = engine.max_batch_size + uses_graphs(device, engine)  # CUDA graphs' scratch row
    total = weights + packed + 2 * config.n_layer * rows * config.block_size * config.n_embd * kv
    if engine.speculative_model not in (None, NGRAM):
        draft = Path(engine.speculative_model)
        meta = read_config(draft)
        total += memory_needed(GPTConfig.from_dict(meta["model"]), (draft / WEIGHTS_FILE).stat().st_size,
                               replace(engine, speculative_model=None),
                               quantized=meta.get("quantization", "none") != "none")
    return total


def uses_graphs(device: torch.device, config: EngineConfig) -> bool:
    """Whether decode steps replay CUDA graphs (model/engine/graphs.py): on CUDA, unless `enforce_eager`."""
    return device.type == "cuda" and not config.enforce_eager


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        """The model of `checkpoint` on `config`'s device, dtype and threads, with a KV-cache row per batch slot."""
        self.device = resolve_device(config.device)
        self.dtype = config.dtype or default_dtype(self.device)
        # CPU threads: as asked, else by the model's size (the engine's thread applies them: on_engine_thread)
        self.threads = 0
        if self.device.type == "cpu":
            self.threads = config.threads or default_threads(checkpoint.config.num_params())
            torch.set_num_threads(self.threads)
            keep_freed_memory()  # a step's temporaries reused, not faulted in again (model/malloc.py)
        # the CPU decode kernels (built once and cached; torch's ops serve where they cannot be): /info says which
        self.cpu_kernels = "not used on this device"
        if self.device.type == "cpu" and self.dtype == torch.float32:
            kernels.load()
            self.cpu_kernels = kernels.status()
        self.model = checkpoint.model.to(device=self.device, dtype=self.dtype).eval()
        # the kernels' modules in place of torch's, with packed weights for batched decode steps (as much memory
        # again as the weights); nothing where the kernels are not used
        self.packed_bytes = kernels.install(self.model).packed_bytes
        self.block_size = checkpoint.config.block_size
        # a cache row per batch slot
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.model, self.dtype)
        self.max_batch_size = config.max_batch_size
        # with CUDA graphs, one row more: the scratch row their padding writes into
        rows = config.max_batch_size + uses_graphs(self.device, config)
        self.cache = KVCache(checkpoint.config, rows, device=self.device, dtype=self.kv_dtype)
        # decode steps replayed as CUDA graphs: /info says how many, or why none
        self.graphs: DecodeGraphs | None = None
        self.cuda_graphs = "not used on this device" if self.device.type != "cuda" else "off (--enforce-eager)"
        if uses_graphs(self.device, config):
            try:
                self.decode_through_graphs(capture=True, compile=config.compile)
                assert self.graphs is not None
                compiled = ", the step compiled" if config.compile else ""
                self.cuda_graphs = f"{len(self.graphs)} captured in {self.graphs.capture_seconds:.1f} s{compiled}"
            except Exception as e:  # a step that cannot be captured still decodes, eagerly
                log.warning("CUDA graphs could not be captured, decoding eagerly: %s", e)
                self.graphs = None
                self.cuda_graphs = f"failed to capture ({type(e).__name__}), decoding eagerly"

    @property
    def kv_cache_bytes(self) -> int:
        """The keys and values of every layer and row."""
        return 2 * self.cache.k.numel() * self.cache.k.element_size()

    def decode_through_graphs(self, *, capture: bool, compile: bool = False) -> None:
        """Decode steps through `DecodeGraphs` from now on (captured with `capture`; uncaptured, the same static
        buffers, buckets and padding run eagerly: how the CPU tests check them); with `compile`, the step they hold
        is compiled first (torch.compile, shapes dynamic: a compile for one row, one for the rest, instead of one per
        bucket). A KV cache without the scratch row the padding writes into (the CPU's) is made anew with it: call
        before the first forward."""
        if self.cache.batch_size == self.max_batch_size:
            self.cache = KVCache(self.model.config, self.max_batch_size + 1, device=self.device, dtype=self.kv_dtype)
        step = torch.compile(self._graph_step, dynamic=True, fullgraph=True) if compile else self._graph_step
        self.graphs = DecodeGraphs(step, max_rows=self.max_batch_size, block_size=self.block_size,
                                   scratch_row=self.max_batch_size, device=self.device, capture=capture)

    def release(self) -> None:
        """The CUDA graphs freed now, once the engine has stopped (on its thread, after its last step), not whenever
        the garbage collector gets to them: a graph destroyed while another engine in this process captures (a
        reload, the next engine of a benchmark) fails that capture."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
            self.cuda_graphs = "released (the engine stopped)"

    def _graph_step(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                    context: int) -> torch.Tensor:
        """The decode step a graph holds: `ids` (B, 1) at `positions` (B, 1) of cache `rows` (B,), attending to the
        first `context` slots of each row (masked at its position): logits (B, vocab)."""
        return self.model(ids, self.cache.step(positions, rows, context))[:, 0]

    def on_engine_thread(self) -> None:
        """First thing on the engine's thread: its kernel jobs and torch ops use this model's thread count (the
        kernels' pool is the process's; another engine in the process keeps its own count)."""
        if self.device.type == "cpu":
            kernels.use_threads(self.threads)

    def decode_context(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward the kernels' fused blocks take (a decode step, a prompt chunk): torch's remaining ops on
        this thread alone (the kernels use their own pool)."""
        return kernels.serial_torch_ops()

    def use_adapters(self) -> None:
        """Let forwards apply LoRA adapters per row (`lora.attach`: hooks on the blocks' products, after the kernels'
        swap); once, before the first adapter is used."""
        lora.attach(self.model)

    def forward_chunks(self, rows: list[int], chunks: list[list[int]], starts: list[int], *,
                       every_position: bool = False,
                       adapters: Sequence[lora.LoraAdapter | None] = ()) -> torch.Tensor:
        """Forward each chunk at positions start.. in its own cache row, right-padded to the longest; the logits of
        each chunk's last token, (len(rows), vocab), or with `every_position` of every token, (len(rows), width,
        vocab) (a padded chunk's rows past its length are meaningless). `adapters[i]`: the LoRA adapter chunk i
        runs through (None or none given: the base)."""
        width = max(len(c) for c in chunks)
        last = self.block_size - 1
        idx = [c + [0] * (width - len(c)) for c in chunks]
        pos = [[min(start + t, last) for t in range(width)] for start in starts]
        take = None if every_position else self._ids([len(c) - 1 for c in chunks])
        # a chunk the fused blocks take runs in the decode step's context (an OpenMP team left spinning slowed the
        # kernels' pool by ~5%)
        fused = len(chunks) * width <= kernels.FUSED_MAX_TOKENS
        with self.decode_context() if fused else contextlib.nullcontext():
            step = self.cache.step(self._ids(pos), self._ids(rows), min(self.block_size, max(starts) + width))
            with lora.applying(adapters, self.device):
                logits = self.model(self._ids(idx), step, take)
        return logits if every_position else logits[:, 0]

    def decode(self, rows: list[int], tokens: list[int] | torch.Tensor, positions: list[int],
               adapters: Sequence[lora.LoraAdapter | None] = ()) -> torch.Tensor:
        """One token per row, `tokens[i]` at `positions[i]` of cache row `rows[i]`, through `adapters[i]` (as in
        `forward_chunks`): logits (len(rows), vocab). `tokens`: ids on the host, or a tensor of them on this device
        (a step's chosen tokens, not yet seen by the host: running ahead). A CUDA graph's replay where one holds
        the step."""
        if self.graphs is not None and all(a is None for a in adapters):
            key = self.graphs.bucket(len(rows), max(positions) + 1)
            if key is not None:
                return self.graphs.run(key, rows, tokens, positions)
        # rows 0..n-1 in order need no index (cheaper without the kernels)
        row_idx = None if rows == list(range(len(rows))) else self._ids(rows)
        step = self.cache.step(self._ids([[p] for p in positions]), row_idx, max(positions) + 1)
        ids = tokens.view(-1, 1) if isinstance(tokens, torch.Tensor) else self._ids([[t] for t in tokens])
        with lora.applying(adapters, self.device):
            return self.model(ids, step)[:, 0]

    def copy_prefix(self, source: int, row: int, length: int) -> None:
        """Row `row` gets the keys and values of positions 0..length-1 of row `source`."""
        for cache in (self.cache.k, self.cache.v):  # (n_layer, rows, n_head, max_len, head_size)
            cache[:, row, :, :length] = cache[:, source, :, :length]

    def _ids(self, values: list) -> torch.Tensor:
        return to_device(values, self.device)
