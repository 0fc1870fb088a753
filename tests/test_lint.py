"""The code base passes ruff (configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests import REPO


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    result = subprocess.run([*cmd, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_model_never_imports_app() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "model").rglob("*.py")
        if any(line.lstrip().startswith(("import app", "from app")) for line in p.read_text().splitlines())
    ]
    assert offenders == []
