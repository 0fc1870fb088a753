"""The servers measured, each a command on a free port of 127.0.0.1 (Folio first, then llama.cpp's `llama-server`
in every build and weight format, then vLLM in each dtype), and starting and stopping them: each in a process group
of its own (vLLM runs its engine in child processes), none outliving the run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.testing import ServerError, free_port, launch, wait_healthy
from app.testing import stop as stop_process
from bench import REPO
from bench.peers import CONTEXT, LLAMA_QUANTIZED, MODEL_ID
from bench.peers.builds import Setup, SetupError
from bench.peers.report import cpu_info

# Folio as served: (name, extra `python -m app` flags), one line per variant: ("folio-int8", ["--quantize", "int8"])
VARIANTS_OF_FOLIO: list[tuple[str, list[str]]] = [
    ("folio", []),
    ("folio-int8", ["--quantize", "int8"]),
    ("folio-bf16", ["--quantize", "bf16"]),
    ("folio-int4", ["--quantize", "int4"]),
]
TIERS = ("native", "avx2")
LLAMA_OUTTYPES = ("f32", "q8_0", *LLAMA_QUANTIZED)
VLLM_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


@dataclass
class Server:
    name: str
    cmd: list[str]  # "{port}" is replaced by the port
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO


# `--tier avx2` on a CPU with more: Folio's kernels (model/kernels/loader.py) and torch's own (ATen's vectorised
# ops, oneDNN's GEMMs and MKL's (fp32 prompts' products: MKL_VERBOSE=1 shows it picking AVX-512 without its
# setting), which would use AVX-512 or AMX) held to AVX2 and FMA, as on an AVX2-only CPU
AVX2_TIER_ENV = {"FOLIO_CPU_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                 "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


# llama.cpp's native build on a CPU with AMX (this version): its AMX kernels for q8_0 and the 4-bit formats die of
# SIGILL at their first tile instruction (tilezero, in a worker thread; seen on a 2-vCPU Sapphire Rapids VM, where
# oneDNN's AMX GEMMs run, and still with the tile state requested by arch_prctl before start). --no-repack keeps
# the weights in their own layout, off AMX's (and off the repacked AVX layouts): its AVX-512 VNNI dot products
NO_AMX = ["--no-repack"]


def server_factories(setup: Setup, threads: int, slots: int, tier: str = "native") -> dict[str, Callable[[], Server]]:
    """Each server by name, as a function that sets up what it needs and returns its `Server`; the order is the
    order they run in (Folio first: the others' greedy text is compared with its). `tier` "avx2": Folio held to
    AVX2 (AVX2_TIER_ENV), llama.cpp's generic builds alone (GGML_NATIVE=OFF: AVX2), no vLLM (whose CPU build
    picks its instruction set itself)."""
    host = ["--host", "127.0.0.1", "--port", "{port}"]
    out: dict[str, Callable[[], Server]] = {}
    for name, extra in VARIANTS_OF_FOLIO:
        out[name] = lambda name=name, extra=extra: Server(name, [
            sys.executable, "-m", "app", "--checkpoint", str(setup.folio_checkpoint()), *host, "--model-id", MODEL_ID,
            "--threads", str(threads), "--max-batch-size", str(slots), "--max-waiting", str(4 * slots),
            "--log-level", "warning", *extra], env=AVX2_TIER_ENV if tier == "avx2" else {})
    for native in (False,) if tier == "avx2" else (False, True):
        for outtype in LLAMA_OUTTYPES:
            name = f"llama{'-native' if native else ''}-{outtype}"
            # -np slots of the full context each (-c is shared by the slots); continuous batching is on by default
            out[name] = lambda name=name, native=native, outtype=outtype: Server(name, [
                str(setup.llama_tool(native)), "-m", str(setup.gguf(outtype)), *host, "--alias", MODEL_ID,
                "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * CONTEXT), "-cb",
                *(NO_AMX if native and "amx_tile" in cpu_info()["flags"] else [])])
    for suffix, dtype in VLLM_DTYPES.items() if tier == "native" else ():
        name = f"vllm-{suffix}"
        out[name] = lambda name=name, dtype=dtype: Server(name, [
            str(setup.vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.hf_model()),
            "--served-model-name", MODEL_ID, "--dtype", dtype, "--max-model-len", str(CONTEXT),
            "--max-num-seqs", str(slots), *host], env={
            "LD_PRELOAD": setup.vllm_preload(), "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    return out


LIVE: set[subprocess.Popen] = set()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group, SIGKILL if it lingers."""
    stop_process(proc, group=True, grace=30)
    LIVE.discard(proc)


def stop_all() -> None:
    for proc in list(LIVE):
        stop(proc)


def start(server: Server, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start `server` in its own session, wait for GET /health to answer 200; its output goes to `log`."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in server.cmd]
    proc = launch(cmd, log, env=server.env, cwd=server.cwd, new_session=True, echo_command=True)
    LIVE.add(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, timeout)
    except ServerError as e:
        stop(proc)
        raise SetupError(f"{server.name} ({log}): {e}") from None
    return proc, url
