"""The `folio` command (app/cli.py), run as a process: every subcommand is its module's `main` with the same options
under its own name, `folio --help` lists them, and the exit codes are a shell's: 0 done, 2 a usage mistake in one
`error:` line, 1 a failure while running, 130 Ctrl-C.

Which `folio` runs: the installed script where the installed package is this checkout (CI installs it so), else
`python -m app.cli` from this checkout (a worktree whose editable install points at another one); each failure
message says which, and `test_the_installed_script_is_this_checkouts` skips saying why.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from importlib.metadata import distributions
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import pytest

from app.cli import COMMANDS
from app.testing import SERVER_ARGS, free_port, launch, log_tail, stop, wait_healthy
from tests import REPO


def installed_checkout() -> Path | None:
    """The directory the installed `folio` package was installed from (editable or not), if pip recorded one."""
    # pip's record is in the installed dist-info; the checkout's own folio.egg-info (setuptools leaves it in the
    # working directory, which is on sys.path) has none: look through every distribution named folio
    for dist in distributions(name="folio"):
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        if url.startswith("file://"):
            return Path(unquote(urlparse(url).path)).resolve()
    return None


def folio_command() -> tuple[list[str], str]:
    """The command line that runs `folio` from this checkout, and how it was chosen."""
    script = shutil.which("folio")
    if script is not None and installed_checkout() == REPO.resolve():
        return [script], f"the installed script {script}"
    return [sys.executable, "-m", "app.cli"], (
        f"python -m app.cli (the installed folio package is {installed_checkout()}, not this checkout {REPO})")


FOLIO, HOW = folio_command()
MODULE_COMMAND = {name: [c.module.removesuffix(".__main__")] for name, c in COMMANDS.items()}


def folio(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FOLIO, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def options(help_text: str) -> set[str]:
    """The option strings a --help lists (`-h`, `--help`, `--port`, ...), from the lines that describe options."""
    return {flag for line in re.findall(r"^ +(-.*?)(?:  |$)", help_text, flags=re.M)
            for flag in re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", line)}


def test_pyproject_declares_the_folio_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"folio": "app.cli:main"}
    module, function = scripts["folio"].split(":")
    assert getattr(importlib.import_module(module), function) is importlib.import_module("app.cli").main


def test_the_installed_script_is_this_checkouts() -> None:
    """Where `pip install -e .` was run in this checkout (CI), `folio` on the PATH runs this code."""
    if FOLIO[0] == sys.executable:
        pytest.skip(f"tested through {HOW}")
    r = folio("--version")
    assert r.returncode == 0 and r.stdout.startswith("folio "), (HOW, r.stdout, r.stderr)


def test_help_lists_every_command_with_its_line() -> None:
    r = folio("--help")
    assert r.returncode == 0 and r.stderr == "", (HOW, r.stderr)
    assert r.stdout.startswith("usage: folio <command> [options]"), (HOW, r.stdout)
    for name, command in COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(command.summary)}$", r.stdout, flags=re.M), (HOW, name, r.stdout)
    assert "130" in r.stdout and "exit codes" in r.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_takes_its_modules_options_under_its_own_name(name: str) -> None:
    ours = folio(name, "--help")
    theirs = subprocess.run([sys.executable, "-m", *MODULE_COMMAND[name], "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert ours.returncode == theirs.returncode == 0, (HOW, ours.stderr, theirs.stderr)
    assert ours.stdout.startswith(f"usage: folio {name} "), (HOW, ours.stdout[:200])
    assert "python -m" not in ours.stdout.split("\n\n")[0], (HOW, ours.stdout[:400])  # the usage names folio
    assert options(ours.stdout) == options(theirs.stdout) and len(options(ours.stdout)) > 1, (HOW, name)


def test_a_subcommands_subcommand_is_named_after_it() -> None:
    r = folio("convert", "hf", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: folio convert hf "), (HOW, r.stdout[:200])


@pytest.mark.parametrize(("args", "needles"), [
    ([], ["a command is needed: serve, train, sample, convert, eval, inspect", "(see folio --help)"]),
    (["serf"], ["unknown command 'serf'; did you mean 'serve'?"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["sample", "--bogus"], ["unrecognized arguments: --bogus (see folio sample --help)"]),
    (["eval"], ["the following arguments are required: --data (see folio eval --help)"]),
    (["train", "--preset", "nope"], ["invalid choice: 'nope'", "(see folio train --help)"]),
    (["serve", "--port", "abc"], ["--port (FOLIO_PORT)", "got 'abc'"]),
    (["convert", "hf"], ["required: src_dir, out_dir (see folio convert hf --help)"]),
])
def test_a_usage_mistake_is_one_error_line_and_exit_code_2(args: list[str], needles: list[str]) -> None:
    r = folio(*args)
    assert r.returncode == 2, (HOW, r.returncode, r.stderr)
    assert r.stdout == "" and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (HOW, r.stderr)
    for needle in needles:
        assert needle in r.stderr, (HOW, needle, r.stderr)


def sample_args(checkpoint: Path, tokens: int) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--prompt", "To be", "--greedy", "--max-new-tokens", str(tokens)]


def test_sample_writes_what_the_module_writes(char_checkpoint: Path) -> None:
    ours = folio("sample", *sample_args(char_checkpoint, 40))
    theirs = subprocess.run([sys.executable, "-m", "model.generate", *sample_args(char_checkpoint, 40)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert ours.returncode == theirs.returncode == 0, (HOW, ours.stderr, theirs.stderr)
    assert ours.stdout == theirs.stdout and len(ours.stdout) == len("To be") + 40 + 1, (HOW, ours.stdout)


def as_a_foreground_job() -> None:
    """Ctrl-C's default action, as a terminal's foreground job has it. A command started in the background by a shell
    without job control (`pytest ... &` in a script, CI runners) inherits SIGINT ignored, and Python then leaves it
    ignored (as every Unix program does: `nohup`, `&`), so without this the Ctrl-C test fails wherever the suite
    itself runs in the background."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sampling_forever(checkpoint: Path) -> subprocess.Popen[bytes]:
    """`folio sample` of a million tokens, its first bytes already written (so it is inside the generation)."""
    proc = subprocess.Popen([*FOLIO, "sample", *sample_args(checkpoint, 1_000_000)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_a_foreground_job)
    assert proc.stdout is not None and proc.stdout.read(len("To be") + 1), HOW
    return proc


def test_ctrl_c_exits_130_without_a_traceback(char_checkpoint: Path) -> None:
    proc = sampling_forever(char_checkpoint)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in err, (HOW, proc.returncode, err.decode()[-2000:])


def test_a_closed_output_pipe_exits_1_without_a_traceback(char_checkpoint: Path) -> None:
    """`folio sample ... | head -c 6`: the reader goes away; the command stops, quietly, as a failure."""
    proc = sampling_forever(char_checkpoint)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    assert proc.wait(timeout=60) == 1, (HOW, proc.returncode)
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "Exception ignored" not in err, (HOW, err[-2000:])


def test_serve_serves_and_drains_to_exit_code_0(char_checkpoint: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    proc = launch([*FOLIO, "serve", "--checkpoint", str(char_checkpoint), "--host", "127.0.0.1", "--port", str(port),
                   *SERVER_ARGS], log, env={"OMP_NUM_THREADS": "1"})
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"inputs": "To be", "parameters": {
            "max_new_tokens": 5}}, timeout=60, trust_env=False)
        assert r.status_code == 200 and len(r.json()["generated_text"]) == 5, (HOW, r.text)
    finally:
        stop(proc)
    assert proc.returncode == 0, (HOW, proc.returncode, log_tail(log))
