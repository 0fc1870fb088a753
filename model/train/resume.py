"""Continuing a run exactly: `OUT/last/` holds the latest periodic checkpoint (a LoRA run's: its adapter alone,
`save_model`) and `resume.pt` (step, optimizer,
RNG streams of every rank, best validation loss, tokens seen, wall time). It is swapped in whole: written to
`last.tmp/`, then renamed over `last/` (the old one parked as `last.old/` for the instant between the renames,
which is where a resume looks if a crash hit between them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import read_config, save_checkpoint
from model.files import atomic_path
from model.gpt import GPT
from model.lora.adapter import ADAPTER_CONFIG_FILE, LoRAConfig, read_adapter, save_adapter
from model.tokenizer import Tokenizer

RESUME_FILE = "resume.pt"


def last_dir(out: Path, marker: str = "") -> Path:
    """`out/last`, or `out/last.old` where `last` lacks `marker` (any file, or the folder itself if empty) and
    `last.old` has it: a crash hit between the two renames of a checkpoint swap."""
    last, old = out / "last", out / "last.old"
    if not (last / marker).exists() and (old / marker).exists():
        return old
    return last


def rng_state(batch_gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random streams: torch's (dropout), the batches' and, on CUDA, the device's."""
    state = {"torch_rng": torch.get_rng_state(), "batch_rng": batch_gen.get_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], batch_gen: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(state["torch_rng"].cpu())
    if device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)
    batch_gen.set_state(state["batch_rng"].cpu())


def load_state(last: Path, device: torch.device) -> dict[str, Any]:
    """`resume.pt` of `last`: our own optimizer and RNG state, loaded with weights_only (nothing unpickled)."""
    return torch.load(last / RESUME_FILE, map_location=device, weights_only=True)


def save_model(directory: Path, model: GPT, tokenizer: Tokenizer, training: dict[str, Any],
               lora: LoRAConfig | None = None) -> None:
    """The run's model into `directory`: a Folio checkpoint or, training LoRA, the adapter alone in PEFT's format
    (model/lora.py), whose Folio record holds `training` (the base it adapts under `training["base"]`)."""
    if lora is None:
        save_checkpoint(directory, model, tokenizer, training=training)
    else:
        save_adapter(directory, model, lora, folio={"training": training},
                     base_model_name_or_path=training.get("base", {}).get("source"))


def read_training(directory: Path) -> dict[str, Any]:
    """The training provenance of what `save_model` wrote into `directory`: a checkpoint's or an adapter's."""
    if (directory / ADAPTER_CONFIG_FILE).is_file():
        return read_adapter(directory).folio["training"]
    return read_config(directory)["training"]


def write_last(out: Path, model: GPT, tokenizer: Tokenizer, training: dict[str, Any], state: dict[str, Any],
               lora: LoRAConfig | None = None) -> None:
    """Swap in a complete `out/last/` holding `model` (`save_model`, with `training` as its provenance) and
    `state`."""
    tmp, last, old = out / "last.tmp", out / "last", out / "last.old"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model, tokenizer, training, lora)
    with atomic_path(tmp / RESUME_FILE) as path:
        torch.save(state, path)
    shutil.rmtree(old, ignore_errors=True)
    if last.exists():
        os.replace(last, old)
    os.replace(tmp, last)
    shutil.rmtree(old, ignore_errors=True)
