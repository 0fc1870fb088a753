"""Calibrated 4-bit weights: GPTQ (Frantar et al., 2022, arXiv:2210.17323), in the layout of round-to-nearest int4
(`model.quantize.quantize_groups`: llama.cpp's q4_0, a fp16 scale per group of 32 input weights), so the kernels and
checkpoints are the same ones.

Rounding each weight to its nearest step minimises the weights' error; what matters is the product's, ||X W^T -
X Q^T|| over the inputs X the layer sees. GPTQ quantizes one input column of W at a time, in order, and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse of the inputs' second moment H =
X^T X / n (`model.quantize.calibration`: the fp32 model run over calibration text, a hook on each product), so
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

import torch

from model.kernels.ops import INT4_GROUP
from model.quantize.groups import group_scales, pack_groups, round_to_steps

DAMP = 0.01  # added to H's diagonal, as a fraction of its mean (the paper's percdamp)
BLOCK = 128  # columns quantized before their errors reach the later columns in one product


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
