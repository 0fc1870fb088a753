"""docker/Dockerfile read as instructions and build stages, for the tests of the image and of the manifests that
run it (test_docker.py, test_kubernetes.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

from tests import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each build stage's instructions, by stage name, in order (dicts keep insertion order)."""
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for keyword, args in instructions():
        if keyword == "FROM":
            current = args.split(" AS ")[-1].strip() if " AS " in args else args
            result[current] = []
        elif current is not None:
            result[current].append((keyword, args))
    return result


def runtime_env() -> dict[str, str]:
    """The ENV variables of the image's last stage (the server)."""
    env: dict[str, str] = {}
    for keyword, args in list(stages().values())[-1]:
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args))
    return env
