"""The model's shape: nanoGPT's `GPTConfig`, field for field, so configs map one to one; and what a shape costs
against this machine's memory (all of it, `machine_memory`, or what is left now, `available_memory`), checked
before anything is built."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024  # longest context the position embedding covers
    vocab_size: int = 50304  # GPT-2's 50,257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Build from a dict, refusing unknown or missing fields with a message that names them."""
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config fields {unknown}; expected {sorted(known)}")
        missing = sorted(known - set(data))
        if missing:
            raise ValueError(f"model config is missing fields {missing}")
        return cls(**data)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count computed from the shape (the LM head is tied to `wte`)."""
        d, v, L = self.n_embd, self.vocab_size, self.n_layer
        b = 1 if self.bias else 0
        per_block = (
            2 * d * (1 + b)  # ln_1, ln_2
            + d * 3 * d + b * 3 * d  # c_attn
            + d * d + b * d  # attn.c_proj
            + d * 4 * d + b * 4 * d  # c_fc
            + 4 * d * d + b * d  # mlp.c_proj
        )
        n = v * d + self.block_size * d + L * per_block + d * (1 + b)
        if non_embedding:
            n -= self.block_size * d
        return n

    def summary(self) -> str:
        return (f"n_layer {self.n_layer}, n_embd {self.n_embd}, vocab_size {self.vocab_size}, "
                f"block_size {self.block_size}")

    def check_memory(self, bytes_per_param: float, memory: int, purpose: str, extra_bytes: float = 0) -> None:
        """A ValueError saying so when `purpose` (loading, training) needs more than `memory` bytes: `bytes_per_param`
        bytes per parameter plus `extra_bytes`; O(1), so it can come before anything is built."""
        n = self.num_params()
        need = n * bytes_per_param + extra_bytes
        if need > memory:
            raise ValueError(f"the model ({self.summary()}) has {si(n)} parameters: {purpose} needs at least "
                             f"{si(need)}B, more than this machine's {si(memory)}B of memory")


def si(n: float) -> str:
    """1234567 -> '1.23M': counts and byte sizes in messages (beyond the T range, 7.2e+19)."""
    if abs(n) >= 1e15:
        return f"{n:.2g}"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3g}{prefix}"
    return f"{n:.3g}"


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's physical memory, or its cgroup's limit where lower
    (a container started with --memory)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to compare against
        return 1 << 62
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            value = Path(limit).read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total


def available_memory() -> int:
    """Bytes this process can still take without the machine swapping or its cgroup's limit being hit: /proc/meminfo's
    MemAvailable (free memory plus the page cache the kernel can reclaim), or less where the cgroup's limit less its
    usage (its reclaimable file cache not counted as used) is lower; `machine_memory()` where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cgroups = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file"),  # cgroup v2
               ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                "total_inactive_file"))  # v1
    for limit_file, usage_file, reclaimable in cgroups:
        try:
            limit, usage = Path(limit_file).read_text().strip(), int(Path(usage_file).read_text())
            stat = dict(line.split() for line in (Path(limit_file).parent / "memory.stat").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            left = int(limit) - usage + int(stat.get(reclaimable, 0))
            available = left if available is None else min(available, left)
    return machine_memory() if available is None else max(0, available)
