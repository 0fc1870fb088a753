"""The manual (docs/, mkdocs.yml at the root) builds with `mkdocs build --strict`, offline, into a temporary
directory: a link to a missing page, file or heading, or a page left out of the nav, is a warning (mkdocs.yml's
`validation:`), which --strict makes an error. The README is the way in: its links lead to files that exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests import REPO


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the manual whose mkdocs.yml is in `root`, into `site`."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not about this manual
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(root / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_manual_builds_strict_with_the_benchmarks_figures(tmp_path: Path) -> None:
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0 and "WARNING" not in result.stderr, result.stdout + result.stderr
    site = tmp_path / "site"
    # the figures are the files the benchmarks wrote, published beside the pages (docs/hooks.py) and shown by them
    for name in ("peers.png", "peers.json", "quantize.png", "inspect_sizes.json", "h200/engine_decode.png"):
        assert (site / "bench" / "results" / name).read_bytes() == (REPO / "bench" / "results" / name).read_bytes()
    assert 'src="../bench/results/quantize.png"' in (site / "quantization" / "index.html").read_text()
    # the JSON and kernels.md are included as written, not retyped
    inspect_page = (site / "inspect" / "index.html").read_text()
    assert "&quot;estimate_bytes&quot;" in inspect_page
    first_heading = (REPO / "bench" / "results" / "kernels.md").read_text().splitlines()[0].removeprefix("# ")
    assert first_heading in (site / "kernels" / "index.html").read_text()
    # the architecture page's diagrams reach the page as Mermaid blocks, which Material draws
    assert (site / "architecture" / "index.html").read_text().count('<pre class="mermaid">') == 2
    assert not (site / "hooks.py").exists()


def test_a_broken_link_a_missing_heading_or_an_orphan_page_fails_the_build(tmp_path: Path) -> None:
    """A copy of the manual with one of each mistake: each is reported, and the strict build fails."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "bench" / "results", root / "bench" / "results")
    (root / "docs" / "orphan.md").write_text("# A page no nav names\n")
    with open(root / "docs" / "tests.md", "a") as page:
        page.write("\n[a page](no-such-page.md), [a heading](api.md#no-such-heading), "
                   "[a figure](bench/results/no-such-figure.png), [here](#nothing-here)\n")
    result = build(root, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    warnings = "\n".join(line for line in output.splitlines() if line.startswith("WARNING") or line.startswith("  - "))
    for mistake in ("orphan.md", "'no-such-page.md'", "'#no-such-heading'", "'bench/results/no-such-figure.png'",
                    "'#nothing-here'"):
        assert mistake in warnings, (mistake, output)
    assert "Aborted with 5 warnings in strict mode" in output, output


def test_the_readmes_links_lead_to_files_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not re.match(r"[a-z]+:|#", t)]
    assert any(t.startswith("docs/") for t in targets), targets  # the README leads into the manual
    assert [t for t in targets if not (REPO / t.split("#")[0]).exists()] == []
