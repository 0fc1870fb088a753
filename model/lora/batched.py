"""Serving LoRA adapters: several at once over one base in one batch (a per-row adapter). Reading, checking and
merging an adapter are model/lora/adapter.py's; here an adapter is its factors as the forward hooks use them.

An adapter directory is what PEFT's `save_pretrained` writes for Hugging Face's `GPT2LMHeadModel`:
`adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, `use_rslora`, `target_modules`) and
`adapter_model.safetensors` with keys `base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|
mlp.c_proj}.lora_A.weight` (r, in) and `...lora_B.weight` (out, r). GPT-2's Conv1D stores its weight (in, out),
so PEFT sets `fan_in_fan_out`, but A and B have these shapes either way: the delta a target adds to its output is
`x @ A^T @ B^T * scaling` (scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rslora), which for Folio's
`nn.Linear` (weight (out, in), the same module names as GPT-2's) is a weight change of `scaling * B @ A`.

Serving many adapters over one base (`attach`, then a forward inside `applying(rows)`): a forward hook on each
target linear adds, for the rows of each adapter present, their low-rank product (rows gathered, x @ A^T @ B^T *
scaling, added back with `index_add`), in fp32 whatever the base computes in (int8 or bf16 weights, fp32 or bf16
activations). Rows without an adapter (None) get the base alone. The kernels' fused blocks (model/kernels/modules.py)
add the same deltas inside their one call (`stack_groups`: each adapter's token rows and factors, csrc/block.cpp);
where the fused blocks do not apply the hooks do it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from model.config import GPTConfig
from model.lora.adapter import BLOCK_LINEARS, Adapter, AdapterError, check_adapter, merge_adapter, read_adapter

# largest rank accepted (an adapter is a low-rank change; this bounds what one file can make the server allocate)
MAX_RANK = 1024


@dataclass(eq=False)  # compared by identity: the prefix cache keys rows by the adapter that wrote them
class LoraAdapter:
    """One adapter's factors, fp32: `weights[(layer, target)] = (A (r, in), B (out, r))`."""

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    source: Adapter | None = None  # as read (model/lora/adapter.py)
    _stack: list[torch.Tensor | None] | None = field(default=None, repr=False)

    def stack_factors(self, n_layer: int) -> list[torch.Tensor | None]:
        """The factors as the kernels' `Stack` takes them (csrc/ops.h, LoraGroup): per block, per target linear in
        BLOCK_LINEARS' order, A (r, in) and B transposed (r, out), fp32 and contiguous; None, None for a linear the
        adapter leaves alone. Made once."""
        if self._stack is None:
            factors: list[torch.Tensor | None] = []
            for layer in range(n_layer):
                for target in BLOCK_LINEARS:
                    pair = self.weights.get((layer, target))
                    factors += [None, None] if pair is None else [pair[0], pair[1].T.contiguous()]
            self._stack = factors
        return self._stack

    def to(self, device: torch.device | str) -> LoraAdapter:
        """This adapter with its factors on `device` (itself where they already are)."""
        moved = {k: (a.to(device), b.to(device)) for k, (a, b) in self.weights.items()}
        return LoraAdapter(self.name, self.path, self.rank, self.scaling, moved, self.source)

    @property
    def targets(self) -> list[str]:
        return sorted({target for _, target in self.weights})


def load_adapter(path: str | Path, config: GPTConfig, *, name: str | None = None) -> LoraAdapter:
    """Read the PEFT adapter in directory `path` (model/lora/adapter.py's `read_adapter`) and check it against a
    base of `config`: `AdapterError` (a ValueError) naming what differs (a layer the base lacks, a factor's shape,
    the rank) or what is missing or not supported."""
    path = Path(path)
    try:
        found = path.is_dir()
    except OSError as e:  # a name too long, a loop of links: what pathlib does not swallow
        raise AdapterError(f"adapter directory cannot be read: {path}: {e.strerror}") from None
    if not found:
        raise AdapterError(f"adapter directory not found: {path}")
    adapter = read_adapter(path)
    check_adapter(adapter, config)
    if adapter.config.r > MAX_RANK:
        raise AdapterError(f"{path}: r must be at most {MAX_RANK}, got {adapter.config.r}")
    weights = {}
    for module, (a, b) in adapter.weights.items():  # transformer.h.<layer>.<target>
        _, _, layer, target = module.split(".", 3)
        weights[(int(layer), target)] = (a.float().contiguous(), b.float().contiguous())
    return LoraAdapter(name or path.name, path, adapter.config.r, float(adapter.config.scaling), weights,
                       source=adapter)


def _target_modules(model: nn.Module) -> Iterator[tuple[tuple[int, str], nn.Module]]:
    """Each block's target linears of a GPT, keyed as `LoraAdapter.weights` is."""
    for layer, block in enumerate(model.transformer.h):
        for target in BLOCK_LINEARS:  # a target's path inside a block
            yield (layer, target), block.get_submodule(target)


def merge(model: nn.Module, adapter: LoraAdapter) -> nn.Module:
    """Fold `adapter` into `model`'s weights in place (`merge_adapter`: W += scaling * B @ A); `model`."""
    return merge_adapter(model, adapter.source)


class _Rows:
    """One forward's rows grouped by adapter: (adapter, the batch rows it applies to) for each adapter present."""

    def __init__(self, adapters: Sequence[LoraAdapter | None], device: torch.device) -> None:
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        self.groups = [(adapter, torch.tensor(rows, dtype=torch.long, device=device))
                       for adapter, rows in groups.values()]

    def stack_groups(self, tokens: int, n_layer: int) -> list[tuple[torch.Tensor, float, list[torch.Tensor | None]]]:
        """The groups as the kernels' `Stack` takes them (csrc/ops.h, LoraGroup) for a forward of `tokens` tokens a
        row, flattened to rows of tokens: each adapter's token rows, scaling and factors."""
        return [((idx[:, None] * tokens + torch.arange(tokens, device=idx.device)).reshape(-1), adapter.scaling,
                 adapter.stack_factors(n_layer)) for adapter, idx in self.groups]


_local = threading.local()


def stack_groups(tokens: int, n_layer: int) -> list[tuple[torch.Tensor, float, list[torch.Tensor | None]]]:
    """The adapters this thread's forward applies now, as the kernels' fused blocks take them (`_Rows.stack_groups`;
    a forward of `tokens` tokens a row); [] outside `applying`."""
    rows: _Rows | None = getattr(_local, "rows", None)
    return [] if rows is None else rows.stack_groups(tokens, n_layer)


@contextmanager
def applying(adapters: Sequence[LoraAdapter | None], device: torch.device | str) -> Iterator[None]:
    """Around a forward of an `attach`ed model on this thread: batch row i gets `adapters[i]` (None: the base). With
    no adapter at all nothing changes (the kernels' fused blocks stay in use)."""
    if all(a is None for a in adapters):
        yield
        return
    _local.rows = _Rows(adapters, torch.device(device))
    try:
        yield
    finally:
        _local.rows = None


def _hook(key: tuple[int, str]):  # noqa: ANN202 - a forward hook
    def add_deltas(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        rows: _Rows | None = getattr(_local, "rows", None)
        if rows is None:
            return None
        x = inputs[0]  # (B, T, in): the groups index B
        for adapter, idx in rows.groups:
            factors = adapter.weights.get(key)
            if factors is None:
                continue
            a, b = factors
            delta = (x.index_select(0, idx).to(a.dtype) @ a.T) @ b.T * adapter.scaling  # (n, T, out)
            output = output.index_add(0, idx, delta.to(output.dtype))
        return output
    return add_deltas


def attach(model: nn.Module) -> None:
    """Give `model`'s target linears the hook that applies adapters inside `applying` (once; idempotent). Outside
    `applying` the hook returns at once."""
    if getattr(model, "_lora_attached", False):
        return
    for key, module in _target_modules(model):
        module.register_forward_hook(_hook(key))
    model._lora_attached = True
