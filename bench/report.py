"""What every benchmark does with its figures: percentiles, the JSON report and a PNG drawn by matplotlib
without a display (the Agg backend), both under bench/results/ unless told otherwise, and the CPU's name they
record."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def pct(values: list[float], q: float, empty: float | None = None) -> float | None:
    """The `q` quantile (0..1) of `values` by rank, no interpolation; `empty` where there are none."""
    if not values:
        return empty
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def write_json(path: Path, report: dict[str, Any]) -> None:
    """`report` as indented JSON (anything JSON has no type for written as its str), its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: benchmarks run on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, png: Path, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay out (inside `rect` of the figure, where a figure-wide legend takes the rest), write at 110 dpi and close
    `fig`."""
    fig.tight_layout(rect=rect)
    fig.savefig(png, dpi=110)
    pyplot().close(fig)


def cpu_name() -> str:
    """The CPU's model name as lscpu shows it (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
