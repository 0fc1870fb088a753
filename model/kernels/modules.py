"""The fast path as module swaps: `install(model)` puts kernel-backed modules in place of a GPT's own.

`model/gpt.py` is plain torch. Like gpt-fast's quantization, the kernels replace modules rather than branch
inside `forward`:
- each fp32 CPU `nn.Linear` becomes a `KernelLinear`: the same parameters (the LM head stays tied to the token
  embedding), computed by `ops.linear`, with a packed copy of its weight as a buffer that is not saved;
- quantized weights (`model/quantize`: int8, int4, bf16) are `StoredLinear`s, computed by the same `ops.linear`;
- a model's `Blocks` whose every block (head size a multiple of 8) has such products become `FusedBlocks`: a
  cached forward of up to `FUSED_MAX_TOKENS` tokens at inference runs all the blocks in one kernel call, LoRA
  adapters applied to some rows included (model/lora/batched.py); anything else runs `Blocks.forward` (each
  `Block.forward`).
Parameter names and the state dict are unchanged. Within `kernels.disabled()` both serve torch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from model.gpt import Block, Blocks, CacheStep
from model.kernels import ops
from model.kernels.build import FUSED_MAX_TOKENS
from model.kernels.loader import library
from model.lora import batched as lora


def _version(weight: torch.Tensor) -> int:
    # an inference tensor has no version counter (and can only change within inference mode)
    return -1 if weight.is_inference() else weight._version


class _Registrations:
    """How many modules, parameters and buffers were registered on any module of the process (torch's global
    registration hooks: `setattr` of a module, parameter or buffer, `register_*`), so that a cached view of a model
    can tell cheaply that nothing was swapped since. Tensors put into a module's dicts directly (as `Module._apply`
    does when it cannot convert in place) are not counted: `install` again after moving a model."""

    def __init__(self) -> None:
        self.count = 0
        for register in (nn.modules.module.register_module_module_registration_hook,
                         nn.modules.module.register_module_parameter_registration_hook,
                         nn.modules.module.register_module_buffer_registration_hook):
            register(self._count)

    def _count(self, *_: Any) -> None:
        self.count += 1


registrations = _Registrations()


class KernelLinear(nn.Linear):
    """`nn.Linear` over the same parameters, computed by `ops.linear`: at inference on CPU a few rows go through
    the kernels, from `PACKED_MIN_ROWS` rows on through `packed`, the weight in panels of 16 outputs (as much
    memory again as the weight; a non-persistent buffer). The copy is used only while the weight is the one it
    was made from: an in-place change bumps the weight's version, and the product then reads the weight itself."""

    packed: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: tying and training unchanged
        self.training = linear.training
        self.register_buffer("packed", None, persistent=False)
        self.packed_version: int | None = None  # the weight's version the copy was made from

    def pack(self) -> None:
        """Make the packed copy, unless a current one exists."""
        if self.current_packed() is None:
            self.packed = ops.pack(self.weight)
            self.packed_version = _version(self.weight)

    def current_packed(self) -> torch.Tensor | None:
        """The packed copy if it was made from the weight as it is now, else None."""
        fresh = self.packed is not None and self.packed_version == _version(self.weight)
        return self.packed if fresh else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.current_packed())


class StoredLinear(nn.Module):
    """A linear layer whose weight is stored in another type than fp32 (`stored`: int8 with a fp32 `scale` per
    output row, or bf16); fp32 in and out, computed by `ops.linear` (the kernels widen the weights in registers;
    torch's linear with the dequantized weight elsewhere). `pack()` makes the kernels' packed copy (a buffer that
    is not saved). Subclasses name the stored tensors (their state-dict keys) and make them."""

    packed: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.register_buffer("packed", None, persistent=False)

    @property
    def stored(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def scale_or_none(self) -> torch.Tensor | None:
        return None

    def dequantized(self) -> torch.Tensor:
        return ops.dequantize(self.stored, self.scale_or_none)

    def pack(self) -> None:
        """Make the kernels' packed copy, unless there is one or the products never read it (`ops.reads_packed`)."""
        if self.packed is None and ops.reads_packed(self.stored):
            self.packed = ops.pack(self.stored)

    def current_packed(self) -> torch.Tensor | None:
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.stored, self.bias, self.packed, self.scale_or_none)


# the linear layers the kernels compute (fp32 weights, or stored in another type)
KERNEL_BACKED = (KernelLinear, StoredLinear)
# the KV cache types the fused blocks' attention reads (fp16 widened in registers; csrc/ops.h, kv_cache_type), as
# KERNEL_WEIGHTS names the weight types; `--kv-cache-dtype`'s choices are model/engine/runner.py's
KERNEL_KV_DTYPES = (torch.float32, torch.float16)


def _product_args(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                              torch.Tensor | None]:
    """A kernel-backed linear's weight as stored, bias, scale and packed copy: what the library's `Stack` takes for
    each product."""
    if isinstance(linear, StoredLinear):
        return linear.stored, linear.bias, linear.scale_or_none, linear.packed
    assert isinstance(linear, KernelLinear)
    return linear.weight, linear.bias, None, linear.current_packed()


class FusedBlocks(Blocks):
    """A model's `Blocks` (the same blocks) whose cached forwards at inference run every block in one kernel call:
    the B x T new tokens as rows, each attending to its own cache row up to its position, as `Blocks.forward`
    computes it. Where the kernels do not apply (no cache or a read-only one, training, autograd, more than
    FUSED_MAX_TOKENS tokens, not fp32 on CPU, a cache neither fp32 nor fp16, the kernels disabled, a product no
    longer kernel-backed) it is `Blocks.forward`. The LoRA adapters a forward applies (`lora.applying`) are added
    inside the kernel call, for their rows, as the hooks of model/lora/batched.py add them to `Blocks.forward`."""

    def forward(self, x: torch.Tensor, cache: CacheStep | None = None) -> torch.Tensor:
        lib = library()
        B, T, C = x.size()
        if (lib is None or cache is None or not cache.write or self.training or torch.is_grad_enabled()
                or B * T > FUSED_MAX_TOKENS or x.device.type != "cpu" or x.dtype != torch.float32
                or cache.cache.k.dtype not in KERNEL_KV_DTYPES):
            return super().forward(x, cache)
        stack = self.stack(lib)
        if stack is None:
            return super().forward(x, cache)
        y = stack.forward(x.reshape(B * T, C), cache.cache.k, cache.cache.v, cache.token_rows, cache.token_pos,
                          lora.stack_groups(T, len(self)))
        return y.view(B, T, C)

    def __getstate__(self) -> dict[str, Any]:
        """Copied or pickled without the library's `Stack` (neither can be): a copy makes its own."""
        state = super().__getstate__()
        state.pop("_stack", None)
        return state

    def stack(self, lib: Any) -> Any:
        """The blocks' parameters as the library's `Stack`, or None if a product is not kernel-backed. Kept between
        steps while nothing was registered on any module (`registrations`: a product swapped, quantized or
        repacked, a tensor replaced) and no fp32 product's weight changed in place. Checking the modules themselves
        each step cost 0.15-0.25 ms, 4-7% of an int8 GPT-2 decode step: the step streams the weights through the
        caches, so every Python object read after it misses them."""
        cached = self.__dict__.get("_stack")
        if (cached is not None and cached[0] == registrations.count
                and all(_version(weight) == version for weight, version in cached[1])):
            return cached[2]
        linears = [linear for block in self for linear in _linears(block)]
        if not all(isinstance(linear, KERNEL_BACKED) for linear in linears):
            return None
        products = [_product_args(linear) for linear in linears]
        blocks = [[b.ln_1.weight, b.ln_1.bias, b.ln_2.weight, b.ln_2.bias, *(t for p in products[4 * i: 4 * i + 4]
                                                                               for t in p)]
                  for i, b in enumerate(self)]
        stack = lib.Stack(blocks, self[0].attn.n_head)
        versions = [(linear.weight, _version(linear.weight)) for linear in linears if isinstance(linear, KernelLinear)]
        self.__dict__["_stack"] = (registrations.count, versions, stack)
        return stack


@dataclass(frozen=True)
class InstallReport:
    """What runs on the kernels after `install`."""

    linears: int  # kernel-backed linear layers (KernelLinear, StoredLinear)
    blocks: int  # blocks run fused (in FusedBlocks)
    packed_bytes: int  # packed weight copies' memory: the kernels' current ones, their own GEMMs' (made at first use)


def _packed_bytes(linear: KernelLinear | StoredLinear) -> int:
    """A kernel-backed linear's packed copy's memory: its current one, else the one the kernels' own GEMM makes of
    its stored weight (`ops.own_copy_bytes`), else 0."""
    packed = linear.current_packed()
    if packed is not None:
        return packed.numel() * packed.element_size()
    return ops.own_copy_bytes(linear.stored) if isinstance(linear, StoredLinear) else 0


def _on_cpu_in_fp32(module: nn.Module) -> bool:
    return all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters())


def _swap(model: nn.Module, replace: Callable[[nn.Module], nn.Module | None]) -> None:
    """Put `replace(child)` in place of every child of every module of `model` for which it is not None."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replace(child)
            if new is not None:
                setattr(parent, name, new)


def _kernel_linear(module: nn.Module) -> KernelLinear | None:
    fits = type(module) is nn.Linear and _on_cpu_in_fp32(module)
    return KernelLinear(module) if fits else None


def _linears(block: Block) -> tuple[nn.Module, ...]:
    """A block's four products, in the order the library's `Stack` takes them."""
    return block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj


def _fusable(block: nn.Module) -> bool:
    """A GPT-2 block the kernels run: a head size a multiple of 8, its products kernel-backed, fp32 on CPU."""
    if type(block) is not Block or block.attn.n_embd // block.attn.n_head % 8 != 0:
        return False
    kernel_backed = all(isinstance(linear, KERNEL_BACKED) for linear in _linears(block))
    return kernel_backed and _on_cpu_in_fp32(block)


def _fused_blocks(module: nn.Module) -> FusedBlocks | None:
    if type(module) is not Blocks or not all(_fusable(block) for block in module):
        return None
    fused = FusedBlocks(list(module))
    fused.training = module.training
    return fused


def install(model: nn.Module, *, pack: bool = True) -> InstallReport:
    """Swap `model`'s fp32 CPU `nn.Linear` layers for `KernelLinear`s and then its `Blocks` for `FusedBlocks`, in
    place, and (with `pack`) give every kernel-backed linear a current packed copy of its weight. Nothing happens
    while the kernels are not loaded (`load()`): the model stays torch's. Call it with the model on its device and
    dtype; a second call swaps what is new and repacks weights changed since. The report covers the whole model."""
    if library() is None:
        return InstallReport(linears=0, blocks=0, packed_bytes=0)
    _swap(model, _kernel_linear)
    _swap(model, _fused_blocks)  # after the linears: the fused blocks read their packed copies
    linears = [m for m in model.modules() if isinstance(m, KERNEL_BACKED)]
    if pack:
        for linear in linears:
            linear.pack()  # a new packed copy is a buffer registered: the fused blocks make their Stack again
    blocks = sum(len(m) for m in model.modules() if isinstance(m, FusedBlocks))
    return InstallReport(linears=len(linears), blocks=blocks, packed_bytes=sum(_packed_bytes(m) for m in linears))
