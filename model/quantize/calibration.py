"""Calibration for GPTQ (model/quantize/gptq.py): each product's input second moment over text run through the fp32
model (`calibration_hessians`), the text's windows (`calibration_windows`), and a model quantized to int4 by GPTQ
from a text (`quantize_calibrated`: what `python -m model.quantize --calibration` and bench.quant_quality run)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from model.quantize import four_bit_names, quantize
from model.quantize.gptq import DAMP

CALIBRATION_TOKENS = 4096  # GPT-2 124M's KL from fp32 a third of round-to-nearest's with these (docs/quantization.md)
CALIBRATION_WINDOW = 128  # tokens a calibration sequence (at most the model's context)


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
