"""LoRA adapters in PEFT's format over a Folio GPT: loading and checking one against its base, applying several
at once in one batch (a per-row adapter), and folding one into the base's weights.

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
activations). Rows without an adapter (None) get the base alone. The kernels' fused blocks cannot add the deltas:
while a forward of this thread applies an adapter (`active()`), they run the torch blocks (model/kernels/modules.py),
whose kernel-backed linears still compute the base products.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file

from model.config import GPTConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# a target's path inside a block (Folio's module names are GPT-2's) -> (in_features, out_features) for a config
TARGET_SHAPES = {
    "attn.c_attn": lambda c: (c.n_embd, 3 * c.n_embd),
    "attn.c_proj": lambda c: (c.n_embd, c.n_embd),
    "mlp.c_fc": lambda c: (c.n_embd, 4 * c.n_embd),
    "mlp.c_proj": lambda c: (4 * c.n_embd, c.n_embd),
}
# PEFT's key for one target's factor (it drops the adapter's name, "default", when it saves)
_KEY = re.compile(r"^base_model\.model\.transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                  r"\.lora_([AB])\.weight$")
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
    base_model: str | None = None  # `base_model_name_or_path` as the adapter records it

    def to(self, device: torch.device | str) -> LoraAdapter:
        """This adapter with its factors on `device` (itself where they already are)."""
        moved = {k: (a.to(device), b.to(device)) for k, (a, b) in self.weights.items()}
        return LoraAdapter(self.name, self.path, self.rank, self.scaling, moved, self.base_model)

    @property
    def targets(self) -> list[str]:
        return sorted({target for _, target in self.weights})


def _read_config(path: Path) -> dict:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{config_path} is missing: expected a directory written by PEFT's save_pretrained")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type must be LORA, got {config.get('peft_type')!r}")
    for name, bad in (("use_dora", True), ("bias", "all"), ("bias", "lora_only")):
        if config.get(name) == bad:
            raise ValueError(f"{name}={bad!r} is not supported (plain LoRA only: use_dora false, bias 'none')")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise ValueError(f"{name} is not supported: every target must share r and lora_alpha")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        raise ValueError(f"r must be an integer in [1, {MAX_RANK}], got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha must be a finite number, got {alpha!r}")
    return config


def load_adapter(path: str | Path, config: GPTConfig, *, name: str | None = None) -> LoraAdapter:
    """Read the PEFT adapter in directory `path` and check it against a base of `config`: ValueError naming what
    differs (a layer the base lacks, a target it has not, a factor's shape, the rank) or what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"adapter directory not found: {path}")
    peft = _read_config(path)
    rank = peft["r"]
    scaling = peft["lora_alpha"] / (math.sqrt(rank) if peft.get("use_rslora") else rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"{weights_path} is missing (Folio reads safetensors only, never adapter_model.bin)")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {e}") from None
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{weights_path}: tensor {key!r} is not a LoRA factor of a GPT-2 block's c_attn, "
                             "c_proj or c_fc (embeddings, lm_head and modules_to_save are not supported)")
        layer, target, which = int(match[1]), match[2], match[3]
        if layer >= config.n_layer:
            raise ValueError(f"{key}: layer {layer}, but the base model has {config.n_layer} layers")
        factors.setdefault((layer, target), {})[which] = tensor
    if not factors:
        raise ValueError(f"{weights_path} holds no LoRA factors")
    weights = {}
    for (layer, target), pair in sorted(factors.items()):
        where = f"layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        n_in, n_out = TARGET_SHAPES[target](config)
        if a.shape[0] != rank or b.ndim != 2 or b.shape[1] != rank:
            raise ValueError(f"{where}: rank {a.shape[0]} in lora_A, but r is {rank} in {CONFIG_FILE}")
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the base model "
                             f"needs ({rank}, {n_in}) and ({n_out}, {rank}) (n_embd {config.n_embd})")
        weights[(layer, target)] = (a.float().contiguous(), b.float().contiguous())
    base = peft.get("base_model_name_or_path")
    return LoraAdapter(name or path.name, path, rank, float(scaling), weights, base if isinstance(base, str) else None)


def _target_modules(model: nn.Module) -> Iterator[tuple[tuple[int, str], nn.Module]]:
    """Each block's target linears of a GPT, keyed as `LoraAdapter.weights` is."""
    for layer, block in enumerate(model.transformer.h):
        for target in TARGET_SHAPES:
            yield (layer, target), block.get_submodule(target)


def merge(model: nn.Module, adapter: LoraAdapter) -> nn.Module:
    """Fold `adapter` into `model`'s weights in place (fp32 `nn.Linear` targets: W += scaling * B @ A); `model`."""
    modules = dict(_target_modules(model))
    with torch.no_grad():
        for key, (a, b) in adapter.weights.items():
            weight = modules[key].weight
            weight += (adapter.scaling * (b @ a)).to(weight.device, weight.dtype)
    return model


class _Rows:
    """One forward's rows grouped by adapter: (adapter, the batch rows it applies to) for each adapter present."""

    def __init__(self, adapters: Sequence[LoraAdapter | None], device: torch.device) -> None:
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        self.groups = [(adapter, torch.tensor(rows, dtype=torch.long, device=device))
                       for adapter, rows in groups.values()]


_local = threading.local()


def active() -> bool:
    """Whether a forward of this thread applies an adapter to some row now (inside `applying`)."""
    return getattr(_local, "rows", None) is not None


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
