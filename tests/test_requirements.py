"""What the suite needs beyond pip, as docs/tests.md lists it: on a machine without the test data or a C++
compiler the tests that need them skip and say what is missing (FOLIO_TEST_DATA points them at another data
directory); and CI runs exactly the README's commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from tests import REPO


def commands(script: str) -> list[str]:
    """Shell commands, continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", script)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def quickstart_commands() -> list[str]:
    """The shell commands in README's Quickstart code blocks."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return [c for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) for c in commands(block)]


def test_ci_runs_the_readme_test_command() -> None:
    test_command = next(c for c in quickstart_commands() if "pytest" in c)
    assert commands((REPO / ".ci" / "run").read_text())[-1] == test_command


def test_the_manual_installs_as_the_readme_does() -> None:
    """docs/ repeats the Quickstart's commands (Home, Tests): word for word, so that they cannot drift apart."""
    pages = sorted((REPO / "docs").glob("*.md"))
    repeated = [c for page in pages for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
                for c in commands(block) if c.startswith("pip install -c constraints.txt")]
    assert len(repeated) >= 2 and set(repeated) <= set(quickstart_commands()), repeated


def test_quickstart_installs_torch_from_pytorchs_cpu_index() -> None:
    """On an ordinary Linux machine PyPI's torch pulls ~20 CUDA packages: the pin names the CPU build (a local
    version PyPI does not have) and both install commands first take torch alone from the index that has it."""
    installs = [c for c in quickstart_commands() if c.startswith("pip install")]
    assert len(installs) == 2, installs
    torch_step = "pip install -c constraints.txt --no-deps --index-url https://download.pytorch.org/whl/cpu torch && "
    assert all(c.startswith(torch_step) and " && pip install -c constraints.txt -e " in c for c in installs), installs
    pins = [Requirement(line) for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.startswith("torch==")]
    linux = [str(p.specifier) for p in pins if p.marker is None or p.marker.evaluate({"sys_platform": "linux"})]
    assert len(linux) == 1 and re.fullmatch(r"==[0-9.]+\+cpu", linux[0]), pins


def test_missing_data_and_compiler_skip_with_the_reason(tmp_path: Path) -> None:
    """Without GPT-2's BPE files or a C++ compiler, the tests that need them skip, naming what is missing."""
    env = {**os.environ, "FOLIO_TEST_DATA": str(tmp_path / "data"), "CXX": str(tmp_path / "no-c++"),
           "FOLIO_KERNEL_DIR": str(tmp_path / "kernels")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/model/test_tokenizer.py::test_bpe_is_gpt2s",
         "tests/model/kernels/test_kernels.py::test_disabled_restores"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "2 skipped" in result.stdout, result.stdout + result.stderr
    assert f"not found in {tmp_path / 'data' / 'gpt2-bpe'}" in result.stdout, result.stdout
    assert f"no C++ compiler ({tmp_path / 'no-c++'})" in result.stdout and "apt-get install g++" in result.stdout
