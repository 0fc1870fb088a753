"""`python -m bench.reliability`: run the sections, print a row per section as it ends and a table at the end,
write the JSON report (bench/results/reliability.json unless --out); exit status 1 if any requirement failed."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import RESULTS
from bench.reliability import __doc__ as DESCRIPTION
from bench.reliability.harness import FULL, QUICK, Sizes
from bench.reliability.suite import SECTIONS, run_all, summary_line
from bench.report import write_json


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[str, ...], Sizes]:
    p = argparse.ArgumentParser(prog="python -m bench.reliability", description=DESCRIPTION.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the reduced sizes the CI test uses")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "reliability.json")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    for f in dataclasses.fields(Sizes):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(FULL, f.name)), default=None)
    args = p.parse_args(argv)
    only = tuple(s for s in args.only.split(",") if s)
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    sizes = QUICK if args.quick else FULL
    sizes = dataclasses.replace(sizes, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
                                          if getattr(args, f.name) is not None})
    return args, only, sizes


def main(argv: list[str] | None = None) -> int:
    args, only, sizes = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="folio-reliability-"))
    print(f"work directory {workdir}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        results = run_all(sizes, workdir, args.seed, only,
                          report=lambda name, r: print(summary_line(name, r), flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report: dict[str, Any] = {
        "sizes": dataclasses.asdict(sizes), "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average": os.getloadavg()},
        "ok": all(not r["problems"] for r in results.values()), "sections": results,
    }
    write_json(args.out, report)
    print(f"\n{'section':<12} {'verdict':<12} {'time':>9}  figures")
    for name, r in results.items():
        print(summary_line(name, r))
    print(f"\nwrote {args.out} ({report['seconds']} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
