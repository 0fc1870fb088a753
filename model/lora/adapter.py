"""LoRA adapters on Folio's GPT, in PEFT's format: the modules that train them, the files that hold them, and the
merge that folds one into a model.

An adapter adds `scaling * B @ A` to the weight of each linear it targets (`LoRALinear`): A is (r, in), B is
(out, r), `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` where `use_rslora`). A starts as PEFT starts it
(Kaiming-uniform), B at zero, so a fresh adapter leaves the model unchanged.

Targets, by name, as PEFT matches `target_modules` (a module whose name is the target or ends with `.target`):
`c_attn` (attention's q, k, v), `c_proj` (both projections back to the residual: `attn.c_proj` and `mlp.c_proj`),
`c_fc` (the MLP's widening), or `attn.c_proj` / `mlp.c_proj` alone. Folio's GPT names its linears as Hugging Face's
`GPT2LMHeadModel` names its `Conv1D`s, so the names carry over one to one.

The files (`save_adapter`, `read_adapter`), as `PeftModel.save_pretrained` writes them for a GPT-2:
- `adapter_config.json`: PEFT's `LoraConfig` (`peft_type` "LORA", `r`, `lora_alpha`, `lora_dropout`,
  `target_modules`, `fan_in_fan_out` true since GPT-2's layers are `Conv1D`s, `bias` "none").
- `adapter_model.safetensors`: `base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}.
  lora_A.weight` (r, in) and `.lora_B.weight` (out, r), float32. These are `nn.Linear` layouts for PEFT's Conv1D
  too (PEFT transposes the product, not the factors), so Folio's A and B are stored as they are. Folio adds its own
  record (the base's shape and weights' sha256, the training run's provenance) as the safetensors metadata key
  `folio`, a JSON string PEFT ignores.
Reading checks what a server must refuse before it serves: PEFT features this does not implement (DoRA, biases,
per-module ranks or alphas, `modules_to_save`, embedding adapters), tensor names that are no GPT-2 linear, shapes
that disagree with `r` or with the base (`check_adapter`, naming the module, the shape found and the one needed).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import GPTConfig
from model.files import atomic_path, atomic_write_json
from model.gpt import GPT
from model.previews import preview

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)  # what reading an adapter reads
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's own module names
# each GPT-2 block's linears, by their full name inside the block, and (in, out) as multiples of n_embd
BLOCK_LINEARS = {"attn.c_attn": (1, 3), "attn.c_proj": (1, 1), "mlp.c_fc": (1, 4), "mlp.c_proj": (4, 1)}
# what --lora-targets accepts: each block linear's name and its last part (c_proj names both projections)
TARGETS = tuple(sorted({*BLOCK_LINEARS, *(n.split(".")[1] for n in BLOCK_LINEARS)}))
DEFAULT_TARGETS = ("c_attn",)  # PEFT's default for GPT-2
# PEFT settings with a meaning this module does not implement, and the value that means "not used"
UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
               "layer_replication": None, "trainable_token_indices": None, "target_parameters": None}


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit its base; the message names the file, module or setting."""


@dataclass(frozen=True)
class LoRAConfig:
    """An adapter's hyperparameters: rank `r`, `lora_alpha`, `lora_dropout` (training only) and the targets."""

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise AdapterError(f"the LoRA rank r must be a positive integer, got {self.r!r}")
        if not (isinstance(self.lora_alpha, int | float) and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise AdapterError(f"lora_alpha must be a positive number, got {self.lora_alpha!r}")
        if not 0 <= self.lora_dropout < 1:
            raise AdapterError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        unknown = [t for t in self.target_modules if t not in TARGETS]
        if not self.target_modules or unknown:
            raise AdapterError(f"LoRA targets must be among {', '.join(TARGETS)}, got {list(self.target_modules)}")
        object.__setattr__(self, "target_modules", tuple(sorted(set(self.target_modules))))  # one spelling each

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by: alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT computes it."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, name: str) -> bool:
        """Whether the module `name` is a target, by PEFT's rule: the name is a target or ends with '.target'."""
        return any(name == t or name.endswith("." + t) for t in self.target_modules)

    def to_peft(self, base_model_name_or_path: str | None = None) -> dict[str, Any]:
        """PEFT's adapter_config.json for this adapter on a GPT-2."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
                "r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": list(self.target_modules), "fan_in_fan_out": True, "use_rslora": self.use_rslora,
                "inference_mode": True, "init_lora_weights": True, "layers_to_transform": None,
                "layers_pattern": None, **UNSUPPORTED}

    @classmethod
    def from_peft(cls, config: object, source: str = ADAPTER_CONFIG_FILE) -> LoRAConfig:
        """Read PEFT's adapter_config.json, refusing what this module does not implement, naming the setting."""
        if not isinstance(config, dict):
            raise AdapterError(f"{source}: expected a JSON object")
        if config.get("peft_type") != "LORA":
            raise AdapterError(f"{source}: peft_type is {config.get('peft_type')!r}; only LoRA adapters are read")
        for key, unused in UNSUPPORTED.items():
            value = config.get(key, unused)
            if value != unused and not (unused is None and value in ([], {})):
                raise AdapterError(f"{source}: {key}={value!r} is not supported (Folio implements {key}={unused!r})")
        targets = config.get("target_modules")
        if isinstance(targets, str):  # PEFT: a regular expression over the full module names
            raise AdapterError(f"{source}: target_modules is a regular expression ({preview(targets)}); Folio reads "
                               f"a list of names among {', '.join(TARGETS)}")
        if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise AdapterError(f"{source}: target_modules must be a list of names among {', '.join(TARGETS)}, got "
                               f"{preview(targets)}")
        dropout = config.get("lora_dropout") or 0.0
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise AdapterError(f"{source}: lora_dropout must be a number, got {preview(dropout)}")
        try:
            return cls(r=config.get("r"), lora_alpha=config.get("lora_alpha"), lora_dropout=float(dropout),
                       target_modules=tuple(targets or ()), use_rslora=bool(config.get("use_rslora", False)))
        except AdapterError as e:
            raise AdapterError(f"{source}: {e}") from None


class LoRALinear(nn.Module):
    """`base(x) + scaling * B(A(dropout(x)))`: a frozen linear and its trainable low-rank update."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **like)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **like)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init: A random, B zero
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta(self) -> torch.Tensor:
        """The update to the base weight, (out, in): scaling * B @ A."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


def block_linears(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """Every linear an adapter may target in a GPT of `config`: full module name -> (in, out) features."""
    d = config.n_embd
    return {f"transformer.h.{i}.{name}": (a * d, b * d)
            for i in range(config.n_layer) for name, (a, b) in BLOCK_LINEARS.items()}


def add_lora(model: GPT, config: LoRAConfig) -> dict[str, LoRALinear]:
    """Freeze every parameter of `model` and put a fresh adapter on each target (drawn from torch's RNG: seed it
    first for a reproducible A); returns the adapted modules by name."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = {}
    for name in block_linears(model.config):
        if config.targets(name):
            parent, _, attr = name.rpartition(".")
            lora = LoRALinear(model.get_submodule(name), config.r, config.scaling, config.lora_dropout)
            setattr(model.get_submodule(parent), attr, lora)
            adapted[name] = lora
    return adapted


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted linears of `model` (unwrapped from torch.compile or DDP), by their names in the GPT."""
    raw = getattr(model, "_orig_mod", model)
    raw = getattr(raw, "module", raw)
    return {name: m for name, m in raw.named_modules() if isinstance(m, LoRALinear)}


def peft_key(module: str, factor: str) -> str:
    """PEFT's tensor name for `factor` ('A' or 'B') of the adapted module `module` (a Folio/HF GPT-2 name)."""
    return f"{PEFT_PREFIX}{module}.lora_{factor}.weight"


@dataclass
class Adapter:
    """An adapter as read: its config, (A, B) per adapted module (Folio module names), Folio's record if any."""

    config: LoRAConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    folio: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def save_adapter(directory: str | os.PathLike[str], model: nn.Module, config: LoRAConfig, *,
                 folio: dict[str, Any] | None = None, base_model_name_or_path: str | None = None) -> Path:
    """Write `model`'s adapters in PEFT's format into `directory`: the weights first, then the config, each
    atomically (a reader never sees half a file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in lora_modules(model).items():
        tensors[peft_key(name, "A")] = m.lora_A.weight.detach().to("cpu", torch.float32).contiguous()
        tensors[peft_key(name, "B")] = m.lora_B.weight.detach().to("cpu", torch.float32).contiguous()
    if not tensors:
        raise AdapterError("the model has no LoRA modules to save")
    metadata = {"format": "pt", "producer": "folio", "folio": json.dumps(folio or {})}
    with atomic_path(directory / ADAPTER_WEIGHTS_FILE) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    atomic_write_json(directory / ADAPTER_CONFIG_FILE, config.to_peft(base_model_name_or_path))
    return directory


def read_adapter(directory: str | os.PathLike[str]) -> Adapter:
    """Read a PEFT LoRA adapter directory (made by Folio or by PEFT for a GPT-2); checked in itself (names, ranks),
    not yet against a base: `check_adapter` does that."""
    directory = Path(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"{path} is missing: a LoRA adapter is {ADAPTER_CONFIG_FILE} + {ADAPTER_WEIGHTS_FILE}"
                               " (PEFT's save_pretrained)")
    try:
        config = LoRAConfig.from_peft(json.loads(config_path.read_text(encoding="utf-8")), str(config_path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{config_path} is not valid JSON: {e}") from None
    except RecursionError:
        raise AdapterError(f"{config_path} nests too deeply to be an adapter's configuration") from None
    except OSError as e:
        raise AdapterError(f"{config_path} cannot be read: {e.strerror}") from None
    factors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                module, factor = _module_of(key, str(weights_path))
                t = f.get_tensor(key)
                if not t.is_floating_point() or t.dim() != 2:
                    raise AdapterError(f"{weights_path}: {key} is {t.dtype} of shape {tuple(t.shape)}, expected a "
                                       "2-D float tensor")
                if not bool(torch.isfinite(t).all()):  # every request through it would fail at its first token
                    raise AdapterError(f"{weights_path}: {key} holds NaN or infinite values")
                factors.setdefault(module, {})[factor] = t.to(torch.float32)
    except SafetensorError as e:
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {e}") from None
    except OSError as e:
        raise AdapterError(f"{weights_path} cannot be read: {e.strerror}") from None
    weights = {}
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{weights_path}: {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != config.r or b.shape[1] != config.r:
            raise AdapterError(f"{weights_path}: {module} has rank {a.shape[0]} (lora_A {tuple(a.shape)}, lora_B "
                               f"{tuple(b.shape)}), but {ADAPTER_CONFIG_FILE} says r={config.r}")
        if not config.targets(module):
            raise AdapterError(f"{weights_path}: {module} is not among target_modules {list(config.target_modules)}")
        weights[module] = (a, b)
    if not weights:
        raise AdapterError(f"{weights_path} holds no LoRA weights")
    return Adapter(config, weights, _folio_metadata(metadata), directory)


def adapter_provenance(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What Folio recorded in an adapter's weights file (`save_adapter`'s `folio`: its training run), read from the
    file's header alone; {} where there is none or the file cannot be read."""
    try:
        with safe_open(Path(directory) / ADAPTER_WEIGHTS_FILE, framework="pt", device="cpu") as f:
            return _folio_metadata(f.metadata() or {})
    except (SafetensorError, OSError):
        return {}


def _folio_metadata(metadata: dict[str, str]) -> dict[str, Any]:
    try:
        folio = json.loads(metadata.get("folio", "{}"))
    except json.JSONDecodeError:
        return {}
    return folio if isinstance(folio, dict) else {}


def _module_of(key: str, source: str) -> tuple[str, str]:
    """PEFT tensor name -> (Folio module name, 'A' or 'B'), refusing any name that is no GPT-2 block linear's."""
    module, _, tail = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
    parts = module.split(".")
    if (not key.startswith(PEFT_PREFIX) or tail not in ("A.weight", "B.weight") or len(parts) != 5
            or parts[:2] != ["transformer", "h"] or not parts[2].isdigit() or ".".join(parts[3:]) not in BLOCK_LINEARS):
        raise AdapterError(f"{source}: tensor {key!r} is not a LoRA factor of a GPT-2 block linear (expected "
                           f"{peft_key('transformer.h.<i>.<attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj>', 'A|B')})")
    return module, tail[0]


def check_adapter(adapter: Adapter, config: GPTConfig) -> None:
    """Refuse an adapter that does not fit a base of `config`, naming the module and both shapes."""
    linears = block_linears(config)
    where = adapter.path / ADAPTER_WEIGHTS_FILE if adapter.path else "the adapter"
    for module, (a, b) in adapter.weights.items():
        if module not in linears:
            raise AdapterError(f"{where}: {module} is not in the base, which has {config.n_layer} layers")
        n_in, n_out = linears[module]
        r = adapter.config.r
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise AdapterError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; a base "
                               f"of n_embd {config.n_embd} needs lora_A {(r, n_in)} and lora_B {(n_out, r)}")


def apply_adapter(model: GPT, adapter: Adapter) -> dict[str, LoRALinear]:
    """Put `adapter` on `model` as trainable LoRA modules (its weights loaded), the base frozen."""
    check_adapter(adapter, model.config)
    config = LoRAConfig(adapter.config.r, adapter.config.lora_alpha, adapter.config.lora_dropout,
                        adapter.config.target_modules, adapter.config.use_rslora)
    adapted = add_lora(model, config)
    load_adapter_weights(adapted, adapter, source=str(adapter.path))
    return adapted


def load_adapter_weights(adapted: dict[str, LoRALinear], adapter: Adapter, source: str) -> None:
    """Copy `adapter`'s factors into the LoRA modules `adapted`; their sets of modules must be the same."""
    if set(adapted) != set(adapter.weights):
        raise AdapterError(f"{source}: adapts {_names(adapter.weights)}, the model has adapters on {_names(adapted)}")
    with torch.no_grad():
        for name, m in adapted.items():
            a, b = adapter.weights[name]
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    return f"{len(names)} modules ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})"


@torch.no_grad()
def merge_adapter(model: GPT, adapter: Adapter) -> GPT:
    """Fold `adapter` into `model`'s weights in place (W += scaling * B @ A, in float32): the merged model computes
    what the base with the adapter computes."""
    check_adapter(adapter, model.config)
    scaling = adapter.config.scaling
    for name, (a, b) in adapter.weights.items():
        weight = model.get_submodule(name).weight
        weight.copy_((weight.float() + (b @ a) * scaling).to(weight.dtype))
    return model


def trainable_parameters(config: GPTConfig, lora: LoRAConfig) -> int:
    """Parameters an adapter of `lora` holds on a base of `config`: r * (in + out) per targeted linear."""
    return sum(lora.r * (n_in + n_out) for name, (n_in, n_out) in block_linears(config).items()
               if lora.targets(name))
