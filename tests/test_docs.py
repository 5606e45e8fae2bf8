"""The documentation site builds with `mkdocs build --strict`, and the strict build really fails on
a broken link, a nav entry without its page, and a page left out of the nav (checked on temp copies
of the docs). No network: every page, the API reference (mkdocstrings reads the source statically)
and the benchmark results (docs/hooks/benchmark_pages.py) come from the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch  # mkdocs builds in a process of its own

REPO = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2, not ours
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_project(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied (to be broken), the sources the build reads linked."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs")
    for name in ("unifit", "benchmarks"):
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    return root


def test_site_builds_strict_with_every_page(tmp_path):
    site = tmp_path / "site"
    result = build(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    for page in (REPO / "docs").rglob("*.md"):  # every page of docs/ (one left out of the nav fails the build)
        rel = page.relative_to(REPO / "docs").with_suffix("")
        target = site / (rel.parent if rel.name == "index" else rel) / "index.html"
        assert target.is_file(), f"docs/{rel}.md was not built into {target}"
    for result_md in (REPO / "benchmarks" / "results").glob("*.md"):  # rendered in place, not copied into docs/
        html = (site / "benchmarks" / result_md.stem / "index.html").read_text()
        heading = next(line for line in result_md.read_text().splitlines() if line.startswith("# "))
        words = re.findall(r"[A-Za-z0-9]+", heading)
        assert "<h1" in html and all(word in html for word in words), (
            f"benchmarks/results/{result_md.name} not rendered"
        )
    api = {
        "trainer": ["trainer.trainer.Trainer", "trainer.trainer.Trainer.fit", "config.schema.TrainerConfig"],
        "modules": [
            "frameworks.torch.module.TrainModule",
            "frameworks.keras.module.KerasModule",
            "frameworks.module.ModuleBase.log",
        ],
        "callbacks": ["loop.callback.Callback", "loop.callback.Callback.on_epoch_end"],
        "strategies": [
            "strategies.base.Strategy",
            "strategies.base.Strategy.barrier",
            "strategies.base.TorchDistributedStrategy",
        ],
    }
    for page, objects in api.items():  # mkdocstrings anchors each documented object by its path
        html = (site / "api" / page / "index.html").read_text()
        for name in objects:
            assert f'id="unifit.{name}"' in html, f"unifit.{name} missing from the API reference (api/{page})"
    assert "max_epochs" in (site / "config" / "index.html").read_text()


def _broken_link(root: Path) -> str:
    page = root / "docs" / "storage.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    return "no-such-page.md"


def _nav_without_page(root: Path) -> str:
    config = root / "mkdocs.yml"
    text = config.read_text()
    assert "  - Storage: storage.md\n" in text
    config.write_text(text.replace("  - Storage: storage.md\n", "  - Storage: storage.md\n  - Gone: gone.md\n"))
    return "gone.md"


def _page_not_in_nav(root: Path) -> str:
    (root / "docs" / "orphan.md").write_text("# Orphan\n\nNo nav entry points here.\n")
    return "orphan.md"


def test_strict_build_fails_on_broken_docs(tmp_path):
    """One build of a broken copy: strict mode reports every warning before it aborts, so each
    breakage must be named in the output (each alone is a warning, and so a failed build)."""
    root = copy_project(tmp_path)
    culprits = [breakage(root) for breakage in (_broken_link, _nav_without_page, _page_not_in_nav)]
    result = build(root / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0, f"the strict build passed despite {culprits}:\n{result.stderr}"
    for culprit in culprits:
        assert culprit in result.stderr, f"{culprit} not reported:\n{result.stderr}"
