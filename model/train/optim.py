"""The optimisation: AdamW with weight decay on matrices only (on what trains: a LoRA run's adapter alone), its
learning-rate schedule, the bytes its state takes, and the FLOPs a token costs (for the throughput benchmark's
MFU)."""

from __future__ import annotations

import math

import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.train.config import TrainConfig


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def configure_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (2D+ tensors) only; fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token (PaLM appendix B, as nanoGPT's estimate_mfu): 6N + 12 L T d."""
    n = config.num_params(non_embedding=True)
    return 6 * n + 12 * config.n_layer * config.block_size * config.n_embd


def adamw_state_bytes(params: int, tensors: int) -> int:
    """The bytes of AdamW's state for `params` trained float32 parameters in `tensors` tensors: two moments of 4
    bytes per parameter, and one float32 step count per tensor (torch's non-capturable AdamW)."""
    return 8 * params + 4 * tensors
