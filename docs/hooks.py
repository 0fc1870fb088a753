"""MkDocs hook (mkdocs.yml `hooks:`): the benchmarks' figures, as they wrote them under bench/results/, are files
of the site at the same path, so that a page shows a PNG or links a JSON (`bench/results/peers.png` from a page at
the top of docs/) without a copy in docs/ to keep in step. A link to a figure that is not there is then a missing
file like any other, which `mkdocs build --strict` refuses. The benchmarks' markdown (bench/results/kernels.md) is
included into a page with pymdownx.snippets instead, so it is not published a second time here."""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PUBLISHED = (".png", ".json")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).resolve().parent
    results = root / "bench" / "results"
    for path in sorted(results.rglob("*")):
        if path.is_file() and path.suffix in PUBLISHED:
            src_uri = path.relative_to(root).as_posix()
            if files.get_file_from_path(src_uri) is not None:
                raise ValueError(f"docs/{src_uri} would hide the benchmark's {src_uri}: remove it from docs/")
            files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files
