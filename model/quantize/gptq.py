"""Calibrated 4-bit weights: GPTQ (Frantar et al., 2022, arXiv:2210.17323), in the layout of round-to-nearest int4
(`model.quantize.quantize_groups`: llama.cpp's q4_0, a fp16 scale per group of 32 input weights), so the kernels and
checkpoints are the same ones.

Rounding each weight to its nearest step minimises the weights' error; what matters is the product's, ||X W^T -
X Q^T|| over the inputs X the layer sees. GPTQ quantizes one input column of W at a time, in order, and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse of the inputs' second moment H =
X^T X / n (`calibration_hessians`: the fp32 model run over calibration text, a forward hook on each product), so
that the inputs' correlations cancel much of it. As in the paper's implementation: H damped by 1% of its mean
diagonal, its inverse's upper Cholesky factor, columns in blocks of 128 with the error applied to later blocks in
one product (the "lazy batch" update). A group's scale is chosen (as q4_0 chooses it) when its first column is
reached, from the group's weights as the errors before it left them. With H the identity (inputs uncorrelated) no
error spreads and the result is round-to-nearest's exactly.

Each product's H comes from the fp32 model's activations (not the partly quantized model's, as the paper's
layer-by-layer pass does): one calibration pass for all. Measured on GPT-2 124M's shape at random init and on a
4-layer model trained on tiny Shakespeare (bench/quant_quality.py, 4,096 calibration tokens of the training split,
evaluated on the validation split): KL divergence from fp32 about a half and a third of round-to-nearest's.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from model.kernels.ops import INT4_GROUP
from model.quantize import four_bit_names, group_scales, pack_groups, quantize, round_to_steps

DAMP = 0.01  # added to H's diagonal, as a fraction of its mean (the paper's percdamp)
BLOCK = 128  # columns quantized before their errors reach the later columns in one product
CALIBRATION_TOKENS = 4096  # GPT-2 124M's KL from fp32 a third of round-to-nearest's with these (docs/quantization.md)
CALIBRATION_WINDOW = 128  # tokens a calibration sequence (at most the model's context)


def gptq_groups(weight: torch.Tensor, hessian: torch.Tensor, *, damp: float = DAMP,
                block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (O, I) as `quantize_groups` stores it (nibbles (O, I / 2), fp16 scales (O, I / 32)), each column's
    rounding error spread over the later columns by `hessian` (I, I), the second moment of the product's inputs."""
    w = weight.detach().float().clone()
    out, n_in = w.shape
    assert n_in % INT4_GROUP == 0 and block % INT4_GROUP == 0, (n_in, block)
    h = hessian.detach().to(w.device, torch.float32).clone()
    dead = h.diagonal() == 0  # an input that is always 0: its weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(damp * h.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    steps = torch.empty_like(w)
    scales = torch.empty(out, n_in // INT4_GROUP, 1, device=w.device)
    for start in range(0, n_in, block):
        end = min(start + block, n_in)
        cols, inv = w[:, start:end].clone(), inverse[start:end, start:end]
        errors = torch.empty(out, end - start, device=w.device)
        for i in range(end - start):
            if i % INT4_GROUP == 0:
                group = (start + i) // INT4_GROUP
                scales[:, group] = group_scales(cols[:, i:i + INT4_GROUP])
                scale = scales[:, group, 0]
            steps[:, start + i] = round_to_steps(cols[:, i], scale)
            errors[:, i] = (cols[:, i] - steps[:, start + i] * scale) / inv[i, i]
            cols[:, i:] -= errors[:, i, None] * inv[i, i:]
        w[:, end:] -= errors @ inverse[start:end, end:]
    return pack_groups(steps.view(out, n_in // INT4_GROUP, INT4_GROUP), scales)


@torch.inference_mode()
def calibration_hessians(model: nn.Module, windows: Sequence[Sequence[int]], names: Sequence[str],
                         progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """For each `nn.Linear` of `model` named in `names`, the second moment X^T X / n of its inputs over `windows`
    of token ids, each run through `model` (fp32) as one sequence; `progress(done, total)` after each window."""
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(names, 0)

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] += x.shape[0]
        return record

    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    try:
        for done, window in enumerate(windows, 1):
            model(torch.tensor([list(window)], device=next(model.parameters()).device))
            if progress is not None:
                progress(done, len(windows))
    finally:
        for handle in handles:
            handle.remove()
    return {name: (sums[name] / counts[name]).cpu() for name in names if counts[name]}


def calibration_windows(ids: Sequence[int], length: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """About `tokens` of the token ids `ids` in windows of `length`, at random places (`seed`); all of `ids`, cut
    into windows, where it holds no more."""
    length = min(length, len(ids))
    if length == 0:
        raise ValueError("the calibration text holds no tokens")
    if len(ids) <= tokens:
        return [list(ids[i:i + length]) for i in range(0, len(ids) - length + 1, length)]
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - length + 1) for _ in range(max(1, tokens // length))]
    return [list(ids[s:s + length]) for s in starts]


def quantize_calibrated(model: nn.Module, encode: Callable[[str], list[int]], context: int, text: bytes,
                        name: str, tokens: int = CALIBRATION_TOKENS,
                        say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`model` (fp32) quantized to int4 in place, its 4-bit products by GPTQ from about `tokens` tokens of the UTF-8
    `text` (a file `name`d so), encoded by `encode`, in windows of at most `context`; `say(line)` reports progress.
    Returns what a checkpoint records of it (config.json's "calibration")."""
    windows = calibration_windows(encode(text.decode("utf-8")), min(CALIBRATION_WINDOW, context), tokens)
    names = four_bit_names(model)
    report = say or (lambda line: None)
    hessians = calibration_hessians(model, windows, names,
                                    lambda done, total: report(f"calibration: {done}/{total} windows"))
    done: list[str] = []

    def product_done(product: str) -> None:
        done.append(product)
        report(f"GPTQ: {len(done)}/{len(names)} products")

    quantize(model, "int4", hessians, progress=product_done)
    return {"method": "gptq", "damp": DAMP, "text": name, "text_sha256": hashlib.sha256(text).hexdigest(),
            "tokens": sum(len(w) for w in windows)}
