"""Everything issue 32 measures on a GPU, prepared here and run there in one command.

A GPU is lent for minutes at a time (the `device` tool: a bare machine with torch, transformers and nvcc, no
network), so the run is prepared ahead, on this machine:

    python -m bench.gpu prepare --nanogpt DIR     # writes .gpu/ (ignored by git): wheels, nanoGPT, data

- the wheels of what the server needs and that machine lacks (FastAPI, pydantic, uvicorn, llguidance...), for
  its Python 3.12, at the versions installed here;
- nanoGPT's own `train.py`, `model.py`, `configurator.py` and shakespeare-char configuration, copied from a clone
  of https://github.com/karpathy/nanoGPT (DIR), with the shakespeare-char data its `prepare.py` makes;
- tiny Shakespeare and GPT-2's BPE files (from ../shared/data) for our trainer and the GPT-2-shaped checkpoint.

There, with `.gpu` carried:

    python -m bench.gpu run --out $OUT --stages train,tests --budget-s 420 --tests-cap-s 100   # about 7 minutes
    python -m bench.gpu run --out $OUT --stages decode,server --budget-s 330   # the next, at once (5 to 6 minutes)

(a 15-minute loan, as an H200 spent it on 2026-11-28: the machine's start about 36 s, nanoGPT's 5,000 iterations
172 s and ours 130 s, the GPU tests 72 to 81 s, decode 117 s, server 184 s; `profile`, `sampling` and `gc` need
a third command)

runs, in order, each stage timed (and killed when the budget is spent) and its output kept in bench/results/<gpu>/
(with --out, also archived there as gpu_results.tar.gz after every stage: unpack it into bench/results/ here):
- `tests`: every GPU-marked test (of the files in GPU_TESTS), the log in gpu_tests.txt;
- `profile`: `bench.step_profile --device cuda`: a decode step's device time (its graph replayed alone) against
  the host's, for both models at 1, 8 and 32 requests, and the kernels an eager step launches;
- `sampling`: `bench.sampling --device cuda` (a step's choice of 1 to 64 rows' tokens, GPT-2's vocabulary, against
  transformers' warpers and `torch.multinomial`);
- `decode`: `bench.engine_decode --device cuda --concurrency 32` (batch 1 against transformers eager and compiled
  with its static cache; 32 concurrent against its static batch, and 32 sampled; async scheduling off at batch 1
  and 32; the bundled model and GPT-2 124M); `--decode-args` replaces the `--concurrency 32` (`--engine-compile`
  adds the engine's compiled step, a minute or more);
- `server`: `bench.server_load --device cuda --requests-per-client 4` (HTTP at 1/8/32/64 streams and its ratio to
  the engine alone); `--server-args` replaces the `--requests-per-client 4`;
- `gc`: `bench.gc_pauses --rounds 4` (the server on CUDA with its heap frozen for the garbage collector and
  without: the longest gap between two tokens and the collections' pauses, under 32 streaming clients);
- `train`: nanoGPT's shakespeare-char run (6 layers, 384 wide, block 256, batch 64, 5,000 iterations, compiled)
  with its own `train.py`, then ours on the same configuration (`--preset shakespeare-char --compile`), one after
  the other: wall time, the last and best validation loss of each, and model FLOPs utilisation from the measured
  tokens/s (nanoGPT's formula, against the GPU's dense bf16 peak): train_vs_nanogpt.json and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import REPO, RESULTS, SHARED_DATA
from bench.report import pyplot, save_figure, write_json

PREPARED = REPO / ".gpu"
STAGES = ("tests", "profile", "sampling", "decode", "server", "gc", "train")
# the test files with GPU tests (the suite's other files need packages that machine lacks)
GPU_TESTS = ("tests/engine/test_cuda.py", "tests/app/test_cuda_server.py", "tests/engine/test_lora.py")
# the server's needs that the GPU machine's image lacks (docs of the device tool list what it holds)
WHEELS = ("fastapi", "fastapi-offline", "starlette", "pydantic", "pydantic-core", "pydantic-settings",
          "python-dotenv", "typing-inspection", "annotated-types", "typing-extensions", "uvicorn", "httptools",
          "opentelemetry-api", "annotated-doc", "llguidance")
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py", "LICENSE")
# dense bf16 peaks, FLOP/s, by the name torch gives the GPU (NVIDIA's data sheets; SXM parts)
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
EVAL_LINE = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
ITER_LINE = re.compile(r"^iter (\d+):|(?<![\d.])(\d+)/\d+ \[", re.M)
NANOGPT_TIME = re.compile(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", re.M)
BAR_TOKENS_PER_S = re.compile(r"tok_s=([\d,]+)\]")
TOKENS_PER_ITER = 64 * 256  # the configuration's batch times block


def prepare(nanogpt: Path) -> None:
    """.gpu/: the wheels, nanoGPT with its shakespeare-char data, and the shared data files."""
    from importlib.metadata import version

    wheels = PREPARED / "whl"
    shutil.rmtree(PREPARED, ignore_errors=True)
    wheels.mkdir(parents=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *pins],
                   check=True)
    for name in NANOGPT_FILES:
        target = PREPARED / "nanogpt" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (nanogpt / name).is_file():  # a checkout
            shutil.copy(nanogpt / name, target)
        else:  # a bare clone (the fetch tool's mirror): the file as committed last
            target.write_bytes(subprocess.run(["git", "--git-dir", str(nanogpt), "show", f"HEAD:{name}"],
                                              check=True, capture_output=True).stdout)
    data = PREPARED / "nanogpt" / "data" / "shakespeare_char"
    shutil.copy(SHARED_DATA / "tinyshakespeare" / "input.txt", data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    for sub in ("tinyshakespeare/input.txt", "gpt2-bpe/vocab.bpe", "gpt2-bpe/encoder.json"):
        (PREPARED / "data" / sub).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHARED_DATA / sub, PREPARED / "data" / sub)
    size = sum(f.stat().st_size for f in PREPARED.rglob("*") if f.is_file())
    print(f"{PREPARED}: {size / 2**20:.1f} MiB; carry it: run(carry=['.gpu'], command='python3 -m bench.gpu run "
          f"--out $OUT')")


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


def slug(name: str) -> str:
    """bench/results/<slug>/: "NVIDIA H200" -> h200."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-") or "gpu"


def install_wheels() -> dict[str, str]:
    """The carried wheels installed into /tmp/folio-site, first on the path of this process and its children (where
    the server's packages are missing)."""
    site = "/tmp/folio-site"
    wheels = sorted(str(p) for p in (PREPARED / "whl").glob("*.whl"))
    if wheels and importlib.util.find_spec("fastapi") is None:  # (a machine with the server's needs keeps its own)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", site, *wheels], check=True)
        sys.path.insert(0, site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", FOLIO_TEST_DATA=str(PREPARED / "data"))
    return env


def stage(name: str, cmd: list[str], env: dict[str, str], log: Path, timeout: float,
          cwd: Path = REPO) -> dict[str, Any]:
    """Run one command, its output to `log` and to this process's, killed after `timeout` seconds; how long it took
    and how it ended (returncode -9: killed at its time limit)."""
    print(f"== {name} ({timeout:.0f} s at most): {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout, proc.kill)  # reading the output blocks, so the limit is kept beside it
    watchdog.start()
    try:
        assert proc.stdout is not None
        with open(log, "w") as out:
            for line in proc.stdout:
                out.write(line)
                sys.stdout.write(line)
        rc = proc.wait()
    finally:
        watchdog.cancel()
    seconds = time.perf_counter() - start
    print(f"== {name}: exit {rc} after {seconds:.0f} s", flush=True)
    return {"command": cmd, "returncode": rc, "seconds": seconds}


def train_stage(env: dict[str, str], results: Path, iters: int, left: Callable[[], float], gpu: str,
                device: str = "cuda") -> dict[str, Any]:
    """nanoGPT's train.py, then ours, on nanoGPT's shakespeare-char configuration, both compiled on CUDA (nanoGPT's
    default there). `device` "cpu" is a dry run of the plumbing (uncompiled), not a measurement."""
    nano = PREPARED / "nanogpt"
    runs: dict[str, Any] = {}
    cuda = device == "cuda"
    ours_compile = ["--compile"] if cuda else ["--no-compile"]
    runs["nanogpt"] = stage("train: nanoGPT", [sys.executable, "train.py", "config/train_shakespeare_char.py",
                                                "--out_dir=/tmp/nanogpt-out", f"--max_iters={iters}",
                                                f"--lr_decay_iters={iters}", f"--device={device}",
                                                f"--compile={cuda}"],
                            env, results / "train_nanogpt.log", left() / 2, cwd=nano)  # half: ours the rest
    runs["folio"] = stage("train: Folio", [sys.executable, "-m", "model.train", "--preset", "shakespeare-char",
                                           "--data", str(PREPARED / "data" / "tinyshakespeare" / "input.txt"),
                                           "--out", "/tmp/folio-train", "--overwrite", "--device", device,
                                           *ours_compile, "--max-iters", str(iters), "--lr-decay-iters", str(iters)],
                          env, results / "train_folio.log", left())
    return train_report(results, gpu, iters, runs)


def train_report(results: Path, gpu: str, iters: int, runs: dict[str, Any]) -> dict[str, Any]:
    """train_vs_nanogpt.json and .png from the two runs (`stage`'s records) and their logs in `results`; also
    `python -m bench.gpu report DIR`, from a run's saved records."""
    n_params = 6 * (12 * 384 * 384) + 65 * 384 + 256 * 384  # blocks, token and position embeddings (about 10.7M)
    flops_per_token = 6 * n_params + 12 * 6 * 384 * 256  # nanoGPT's estimate_mfu: 6N + 12 L H Q T / (H Q)
    peak = next((v for k, v in BF16_PEAK.items() if k in gpu), float("nan"))
    for name, run in runs.items():
        log = (results / f"train_{name}.log").read_text()
        run.update(summarize(log, run["seconds"], flops_per_token, peak))
    report = {"gpu": gpu, "iters": iters, "config": "nanoGPT config/train_shakespeare_char.py",
              "tokens_per_iteration": TOKENS_PER_ITER, "nanogpt_reported_val_loss": 1.4697, "runs": runs,
              "complete": all(run["returncode"] == 0 for run in runs.values()),
              "iteration_ms_ratio_folio_over_nanogpt": runs["folio"]["iteration_ms_median"]
              / runs["nanogpt"]["iteration_ms_median"]}
    # the whole runs' wall times compare only where both finished; runs stopped at a time limit, by how far each got
    if report["complete"]:
        report["wall_ratio_folio_over_nanogpt"] = runs["folio"]["seconds"] / runs["nanogpt"]["seconds"]
    else:
        report["iterations_done_ratio_folio_over_nanogpt"] = (runs["folio"]["iterations_done"]
                                                              / max(1, runs["nanogpt"]["iterations_done"]))
    write_json(results / "train_vs_nanogpt.json", report)
    plot_training(report, results / "train_vs_nanogpt.png")
    return report


def read_evals(log: str) -> list[tuple[int, float, float]]:
    """(step, train loss, val loss) of every evaluation a training log reports: nanoGPT's `train.py` and
    `python -m model.train` print the same line."""
    return [(int(s), float(t), float(v)) for s, t, v in EVAL_LINE.findall(log)]


def iterations_done(log: str) -> int:
    """The last iteration a training log reports: nanoGPT's `iter N:` lines, or the `N/total` of Folio's bar."""
    return max((int(a or b) for a, b in ITER_LINE.findall(log)), default=0)


def iteration_ms(log: str) -> list[float]:
    """Milliseconds per iteration as each log reports them: nanoGPT's `time X ms` (every 10th iteration), Folio's
    bar's tokens/s (over the last 10); those spanning an evaluation included (a median sets them aside)."""
    return [float(ms) for ms in NANOGPT_TIME.findall(log)] + [
        1e3 * TOKENS_PER_ITER / float(t.replace(",", "")) for t in BAR_TOKENS_PER_S.findall(log)]


def summarize(log: str, seconds: float, flops_per_token: float, peak: float) -> dict[str, Any]:
    """A training run's figures from its log and wall time: its evaluations, the last and best validation loss, the
    iterations done (fewer than asked where the run was stopped at its time limit), the median milliseconds per
    iteration, and tokens/s and model FLOPs utilisation over the wall time (start-up, compile and evaluations
    included) and at the median iteration."""
    evals = read_evals(log)
    done = iterations_done(log)
    tokens_per_s = done * TOKENS_PER_ITER / seconds
    times = iteration_ms(log)
    ms = statistics.median(times) if times else float("nan")
    return {"evals": evals, "val_loss_last": evals[-1][2] if evals else None,
            "val_loss_best": min((v for _, _, v in evals), default=None), "iterations_done": done,
            "tokens_per_s_overall": tokens_per_s, "mfu_overall": flops_per_token * tokens_per_s / peak,
            "iteration_ms_median": ms, "mfu_median_iteration": flops_per_token * TOKENS_PER_ITER / (ms / 1e3) / peak}


def plot_training(report: dict[str, Any], png: Path) -> None:
    """Validation loss against iterations, nanoGPT's and ours; in the legend, wall time, iterations done (a run
    stopped at its time limit says so) and the median milliseconds per iteration."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in report["runs"].items():
        if run["evals"]:
            steps, _, val = zip(*run["evals"])
            stopped = "" if run["returncode"] == 0 else ", stopped at its time limit"
            ax.plot(steps, val, marker=".", label=f"{name}: {run['iterations_done']} iterations in {run['seconds']:.0f}"
                    f" s{stopped}; {run['iteration_ms_median']:.2f} ms/iteration; last {val[-1]:.4f}")
    ax.axhline(report["nanogpt_reported_val_loss"], ls="--", c="grey", label="nanoGPT's README: 1.4697")
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss")
    ax.set_title(f"shakespeare-char ({report['iters']} iterations asked) on {report['gpu']}")
    ax.legend(fontsize=8)
    save_figure(fig, png)


def run(stages: list[str], out: Path | None, train_iters: int, budget: float, train_device: str = "cuda",
        tests_cap: float = 180, extra: dict[str, list[str]] | None = None) -> int:
    """The stages in order inside `budget` seconds, each given what is left (the tests at most `tests_cap`); after
    each, the results so far archived into `out`, so that a run cut short still brings back what it measured.
    `extra`: further arguments by stage name (the decode and server benchmarks' own), to fit a shorter loan."""
    extra = extra or {}
    env = install_wheels()
    gpu = gpu_name()
    results = RESULTS / slug(gpu)
    results.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"gpu": gpu, "stages": {}}
    start = time.perf_counter()

    def left() -> float:
        return max(30.0, budget - (time.perf_counter() - start))

    py = sys.executable
    for name in stages:
        if name == "tests":  # the GPU-marked tests of GPU_TESTS (their CPU tests run in CI)
            summary["stages"][name] = stage(name, [py, "-m", "pytest", "-q", "-rs", "-m", "gpu", *GPU_TESTS], env,
                                            results / "gpu_tests.txt", min(tests_cap, left()))
        elif name == "profile":
            summary["stages"][name] = stage(name, [py, "-m", "bench.step_profile", "--device", "cuda", "--out-dir",
                                                   str(results)], env, results / "step_profile.log", left())
        elif name == "sampling":
            summary["stages"][name] = stage(name, [py, "-m", "bench.sampling", "--device", "cuda", "--rows",
                                                   "1,8,32,64", "--out-dir", str(results)], env,
                                            results / "sampling.log", left())
        elif name == "decode":
            summary["stages"][name] = stage(name, [py, "-m", "bench.engine_decode", "--device", "cuda",
                                                   "--out-dir", str(results), *extra.get(name, [])],
                                            env, results / "engine_decode.log", left())
        elif name == "server":
            summary["stages"][name] = stage(name, [py, "-m", "bench.server_load", "--device", "cuda", "--bpe-dir",
                                                   str(PREPARED / "data" / "gpt2-bpe"), "--out-dir", str(results),
                                                   "--baseline-requests-per-client", "1", *extra.get(name, [])],
                                            env, results / "server_load.log", left())
        elif name == "gc":
            summary["stages"][name] = stage(name, [py, "-m", "bench.gc_pauses", "--rounds", "4", "--out-dir",
                                                   str(results)], env, results / "gc_pauses.log", left())
        elif name == "train":
            summary["stages"][name] = train_stage(env, results, train_iters, left, gpu, train_device)
        summary["seconds"] = time.perf_counter() - start
        write_json(results / f"gpu_run_{'_'.join(stages)}.json", summary)
        if out is not None:  # what comes back from the machine (8 files at most): everything in one archive
            out.mkdir(parents=True, exist_ok=True)
            shutil.make_archive(str(out / "gpu_results"), "gztar", results.parent, results.name)
    print(json.dumps({k: v.get("returncode", "done") if isinstance(v, dict) else v
                      for k, v in summary["stages"].items()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="here: write .gpu/ (wheels, nanoGPT, data) to carry to the GPU machine")
    prep.add_argument("--nanogpt", type=Path, required=True, help="a clone of karpathy/nanoGPT")
    go = sub.add_parser("run", help="there: the stages, results in bench/results/<gpu>/")
    go.add_argument("--stages", default=",".join(STAGES))
    go.add_argument("--out", type=Path, help="also copy the results here (the device tool's $OUT)")
    go.add_argument("--train-iters", type=int, default=5000)
    go.add_argument("--budget-s", type=float, default=560, help="seconds for all stages; a stage gets what is left")
    go.add_argument("--train-device", default="cuda", help="cpu: a dry run of the train stage's plumbing")
    go.add_argument("--tests-cap-s", type=float, default=180, help="seconds at most for the tests stage")
    go.add_argument("--decode-args", default="--concurrency 32",
                    help="bench.engine_decode's further arguments (--engine-compile: the compiled step too)")
    go.add_argument("--server-args", default="--requests-per-client 4", help="bench.server_load's further arguments")
    rep = sub.add_parser("report", help="here: train_vs_nanogpt.json and .png again from a run's saved records")
    rep.add_argument("results", type=Path, help="a GPU's results folder, bench/results/<gpu>/")
    args = p.parse_args(argv)
    if args.command == "report":
        for record in sorted(args.results.glob("gpu_run_*.json")):
            train = json.loads(record.read_text())["stages"].get("train")
            if train is not None:
                train_report(args.results, train["gpu"], train["iters"], train["runs"])
        return 0
    if args.command == "prepare":
        prepare(args.nanogpt)
        return 0
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(STAGES)}")
    extra = {"decode": shlex.split(args.decode_args), "server": shlex.split(args.server_args)}
    return run(stages, args.out, args.train_iters, args.budget_s, args.train_device, args.tests_cap_s, extra)


if __name__ == "__main__":
    sys.exit(main())
