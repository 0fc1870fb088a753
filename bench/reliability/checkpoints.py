"""Section `checkpoints`: damaged checkpoints refused by `python -m app` at startup, exit code 2 and one line."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.testing import spawn, stop
from bench.reliability.harness import Problems

Case = tuple[str, Path, str]  # (name, directory, what the error line must say)


def _flip(data: bytes, start: int, stop: int) -> bytes:
    flipped = bytearray(data)
    for i in range(start, stop):
        flipped[i] ^= 0xFF
    return bytes(flipped)


def _edit_config(d: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((d / "config.json").read_text())
    edit(meta)
    (d / "config.json").write_text(json.dumps(meta))


def _damaged_bytes(copy: Callable[[str], Path], data: bytes) -> list[Case]:
    """The weights file with bytes flipped (in the tensor data, in the header) or cut short."""
    header = 8 + int.from_bytes(data[:8], "little")
    out = []
    d = copy("flipped bytes in tensor data")
    (d / "model.safetensors").write_bytes(_flip(data, header + 100, header + 164))
    out.append(("flipped bytes in tensor data", d, "sha256"))
    d = copy("flipped bytes in the header")
    (d / "model.safetensors").write_bytes(_flip(data, 10, 40))
    out.append(("flipped bytes in the header", d, "not a readable safetensors file"))
    d = copy("truncated to half")
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    out.append(("truncated to half", d, "not a readable safetensors file"))
    d = copy("truncated to zero bytes")
    (d / "model.safetensors").write_bytes(b"")
    out.append(("truncated to zero bytes", d, "not a readable safetensors file"))
    return out


def _damaged_configs(copy: Callable[[str], Path]) -> list[Case]:
    """config.json that does not describe the weights, or describes a model too large to build."""
    d = copy("wrong shapes")
    _edit_config(d, lambda meta: meta["model"].update(n_embd=48))
    out = [("wrong shapes (config n_embd 48, weights 32)", d, "has shape")]
    d = copy("missing tensors")
    _edit_config(d, lambda meta: meta["model"].update(n_layer=meta["model"]["n_layer"] + 1))
    out.append(("missing tensors (config has one more layer)", d, "does not match the model config"))
    for field, value in (("n_layer", 100_000), ("n_embd", 10**9)):  # refused before anything is built
        d = copy(f"config {field} {value}")
        _edit_config(d, lambda meta, field=field, value=value: meta["model"].update({field: value, "n_head": 1}))
        out.append((f"config.json with {field} {value}", d, "parameters"))
    return out


def _damaged_contents(copy: Callable[[str], Path], weights: Path) -> list[Case]:
    """Well-formed files with bad contents: a NaN among the weights (the hash updated, as a diverged run writes
    it), and a pickle renamed to .safetensors."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    d = copy("non-finite weights")
    with safe_open(weights, framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    diverged = state["transformer.h.0.mlp.c_fc.weight"].clone()
    diverged[3, 5] = float("nan")
    save_file({**state, "transformer.h.0.mlp.c_fc.weight": diverged}, d / "model.safetensors")
    digest = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    _edit_config(d, lambda meta: meta.update(weights_sha256=digest))
    out = [("a NaN among the weights", d, "NaN or infinite")]
    d = copy("pickle renamed")
    torch.save(state, d / "model.safetensors")
    out.append(("pickle renamed to .safetensors", d, "pickle renamed to .safetensors"))
    return out


def damaged_checkpoints(checkpoint: Path, workdir: Path) -> list[Case]:
    """Copies of `checkpoint`, each damaged one way: (name, directory, what the error line must say)."""

    def copy(name: str) -> Path:
        d = workdir / "damaged" / name.replace(" ", "-")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(checkpoint, d)
        return d

    weights = checkpoint / "model.safetensors"
    return [*_damaged_bytes(copy, weights.read_bytes()), *_damaged_configs(copy), *_damaged_contents(copy, weights)]


def run(checkpoint: Path, workdir: Path) -> dict[str, Any]:
    """`python -m app` on each damaged checkpoint, all at once: exit code 2 and one clear line, nothing served."""
    problems = Problems()
    cases = damaged_checkpoints(checkpoint, workdir)
    procs = [(name, d, needle, spawn(d, workdir / f"{d.name}.log")) for name, d, needle in cases]
    rows = {}
    for name, d, needle, proc in procs:
        try:
            rc = proc.wait(180)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = None
        lines = (workdir / f"{d.name}.log").read_text().strip().splitlines()
        rows[name] = {"exit_code": rc, "message": lines[0] if len(lines) == 1 else lines}
        if rc != 2:
            problems.add(f"{name}: exit code {rc}, expected 2")
        if len(lines) != 1 or not lines[0].startswith(f"error: cannot serve {d}") or needle not in lines[0]:
            problems.add(f"{name}: expected one line 'error: cannot serve {d}: ...{needle}...', got {lines}")
    return problems.figures(cases=rows, refused=sum(r["exit_code"] == 2 for r in rows.values()))
