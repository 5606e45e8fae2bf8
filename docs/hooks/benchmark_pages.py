"""MkDocs hook: the committed benchmark results (benchmarks/results/) as pages of the site.

Each `benchmarks/results/*.md` becomes the page `benchmarks/<name>.md` and is appended to the
"Benchmarks" section of the nav, titled by its file name (several results share a heading); images and raw data beside them (.png, .svg, .json, .log, .txt) are
copied too, so a result page may show a plot or link its raw numbers by a relative link. Older run
logs kept for the record (`benchmarks/results/archive/`, raw files only, no pages) are copied to
`benchmarks/archive/`, so a page links them as `archive/<name>`. The files are read where they are
committed (nothing is copied into docs/), and `mkdocs serve` rebuilds when one of them changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

SECTION = "Benchmarks"
PREFIX = "benchmarks"
ASSETS = {".png", ".svg", ".json", ".log", ".txt"}
ARCHIVE = "archive"


def _results_dir(config: Any) -> Path:
    return Path(config.config_file_path).resolve().parent / "benchmarks" / "results"


def _results(config: Any, suffixes: set[str], sub: str = "") -> list[Path]:
    root = _results_dir(config) / sub
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in suffixes) if root.is_dir() else []


def on_config(config: Any) -> Any:
    pages = [{p.stem: f"{PREFIX}/{p.name}"} for p in _results(config, {".md"})]  # titled as the file
    for item in config.nav or []:
        if isinstance(item, dict) and SECTION in item:
            item[SECTION] = [*item[SECTION], *pages]
            break
    else:
        raise ValueError(f"mkdocs.yml: the nav has no '{SECTION}' section for the benchmark results")
    return config


def on_files(files: Files, config: Any) -> Files:
    for path in _results(config, {".md", *ASSETS}):
        files.append(File.generated(config, f"{PREFIX}/{path.name}", abs_src_path=str(path)))
    for path in _results(config, ASSETS, ARCHIVE):  # raw files only: a page there would need a nav entry
        files.append(File.generated(config, f"{PREFIX}/{ARCHIVE}/{path.name}", abs_src_path=str(path)))
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    if _results_dir(config).is_dir():
        server.watch(str(_results_dir(config)))
    return server
