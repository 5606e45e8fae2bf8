"""The docs say what the code does: every strategy of the registry (`unifit.strategies.registry.names()`)
appears in every place that lists strategies, so adding or renaming one fails here until the texts follow.

The places: README.md's strategy table (with each one's framework), docs/index.md, docs/choosing-a-strategy.md
(the one decision table), the schema text of `trainer.strategy`, mkdocs.yml's nav (one page per strategy), the
CLI help (`unifit --help`, `unifit launch --help`), docs/config.md (each strategy's options model), and the
pages that list "the strategies" as a set. The rule for those pages: a page that lists strategies as a set
names, as code (`ddp`), every registered strategy of the framework(s) the page is about (PAGES below); a page
that needs no list links to docs/choosing-a-strategy.md instead of keeping its own. All in-process, no
subprocess: seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from unifit._imports import load_object
from unifit.strategies import registry

REPO = Path(__file__).resolve().parents[1]
NAMES = registry.names()
FRAMEWORK_WORDS = {"torch": "PyTorch", "tensorflow": "Keras"}

# pages that list the strategies as a set -> the frameworks whose strategies they must all name
BOTH = frozenset({"torch", "tensorflow"})
PAGES = {
    "docs/index.md": BOTH,
    "docs/choosing-a-strategy.md": BOTH,
    "docs/concepts.md": BOTH,
    "docs/multi-host.md": BOTH,
    "docs/long-jobs.md": BOTH,
    "docs/zoo.md": BOTH,
    "docs/lightning.md": frozenset({"torch"}),
    "docs/keras.md": frozenset({"tensorflow"}),
}


def expected(frameworks: frozenset[str]) -> list[str]:
    return [name for name in NAMES if registry.entry(name).frameworks & frameworks]


def missing_words(text: str, names: list[str]) -> list[str]:
    """Names not in text as whole words (`ddp` inside `smddp-like` does not count)."""
    return [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]


def missing_code(text: str, names: list[str]) -> list[str]:
    """Names not in a markdown page as code spans (`single`: the word alone is ordinary prose)."""
    return [n for n in names if f"`{n}`" not in text]


def table_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first table under `heading`: strategy name (the first cell's code span) -> cells."""
    section = text.split(heading, 1)[1]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            found = re.search(r"`([^`]+)`", cells[0])
            if found:
                rows[found.group(1)] = cells
        elif rows and not line.startswith("|"):
            break
    return rows


def frameworks_of(cell: str) -> set[str]:
    return {fw for fw, word in FRAMEWORK_WORDS.items() if word in cell}


def read(rel: str) -> str:
    return (REPO / rel).read_text()


def test_the_registry_is_what_these_tests_read():
    assert len(NAMES) >= 9 and len(set(NAMES)) == len(NAMES), NAMES


def test_the_checks_fail_when_a_name_is_missing():
    """The checks themselves: a text without one name is caught, whole words and code spans only."""
    full = ", ".join(f"`{n}`" for n in NAMES)
    assert missing_code(full, NAMES) == [] and missing_words(full, NAMES) == []
    gone = NAMES[1]
    cut = full.replace(f"`{gone}`, ", "")
    assert missing_code(cut, NAMES) == [gone] and missing_words(cut, NAMES) == [gone]
    assert missing_words("smddp-like", ["ddp"]) == ["ddp"]  # a name inside another is not the name


def test_readme_strategy_table_has_every_strategy_with_its_framework_and_a_one_word_status():
    rows = table_rows(read("README.md"), "## Strategies")
    assert sorted(rows) == sorted(NAMES), f"README's strategy table: {sorted(rows)} vs the registry {NAMES}"
    for name, cells in rows.items():
        header_cells = 4  # name | framework | use it when | status
        assert len(cells) == header_cells, f"README row {name}: {cells}"
        assert frameworks_of(cells[1]) == set(registry.entry(name).frameworks), (
            f"README: {name}'s framework cell says {cells[1]!r}, the registry {sorted(registry.entry(name).frameworks)}"
        )
        assert re.fullmatch(r"[\w-]+", cells[3]), f"README: {name}'s status is not one word: {cells[3]!r}"
        assert f"docs/strategies/{name}.md" in cells[0], f"README: {name}'s row does not link its page"


def test_choosing_a_strategy_names_every_strategy_with_its_framework():
    by_name: dict[str, list[str]] = {}  # the first cell is the situation; the second names the strategy
    for line in read("docs/choosing-a-strategy.md").split("## Which fits when", 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("| ") and "`" in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            found = re.search(r"`([^`]+)`", cells[1])
            if found:
                by_name[found.group(1)] = cells
    assert sorted(by_name) == sorted(NAMES), f"choosing-a-strategy.md: {sorted(by_name)} vs {NAMES}"
    for name, cells in by_name.items():
        assert frameworks_of(cells[2]) == set(registry.entry(name).frameworks), (
            f"choosing-a-strategy.md: {name}'s framework cell says {cells[2]!r}"
        )


@pytest.mark.parametrize("page", sorted(PAGES))
def test_pages_that_list_strategies_name_all_of_their_frameworks(page):
    absent = missing_code(read(page), expected(PAGES[page]))
    assert not absent, (
        f"{page} lists the strategies of {sorted(PAGES[page])} but leaves out {absent}: name them (as `code`), "
        "or replace the list by a link to docs/choosing-a-strategy.md and drop the page from PAGES"
    )


def test_schema_text_of_trainer_strategy_names_every_strategy():
    from unifit.config.schema import TrainerConfig

    description = TrainerConfig.model_fields["strategy"].description or ""
    assert not missing_words(description, NAMES), f"TrainerConfig.strategy's description leaves out some: {description}"


def test_mkdocs_nav_has_a_page_per_strategy():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # mkdocs' !!python tags, if any
    config = yaml.load(read("mkdocs.yml"), Loader=Loader)
    section = next(item["Strategies"] for item in config["nav"] if isinstance(item, dict) and "Strategies" in item)
    pages = [p if isinstance(p, str) else next(iter(p.values())) for p in section]
    for name in NAMES:
        assert f"strategies/{name}.md" in pages, f"mkdocs.yml's Strategies nav has no strategies/{name}.md"
        assert (REPO / "docs" / "strategies" / f"{name}.md").is_file(), f"docs/strategies/{name}.md missing"
    assert "strategies/" not in config["site_description"] and "model-parallel" in config["site_description"]


def test_cli_help_names_every_strategy(monkeypatch):
    import argparse

    from unifit.cli.main import _parser

    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps at hyphens; one line per paragraph
    parser = _parser()
    launch = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["launch"]
    for where, text in (("unifit --help", parser.format_help()), ("unifit launch --help", launch.format_help())):
        assert not missing_words(text, NAMES), f"{where} leaves out {missing_words(text, NAMES)}:\n{text}"


def test_config_reference_renders_every_strategys_options():
    from unifit.cli.config_docs import render

    page = render()
    sections = page.split("## `trainer.strategy_options`, per strategy", 1)
    assert len(sections) == 2, "docs/config.md has no per-strategy options section"
    for name in NAMES:
        assert f"### `{name}`" in sections[1], f"config reference: no section for {name}"
        body = sections[1].split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        options = load_object(registry.entry(name).strategy, field="trainer.strategy").Options
        for field in options.model_fields:
            assert f"| `{field}` |" in body, f"config reference: {name}'s option {field} is not rendered"
        if not options.model_fields:
            assert "No options" in body


def test_readme_links_resolve_and_the_results_hold_no_session_named_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", read("README.md")):
        if "://" not in target:
            assert (REPO / target).exists(), f"README links {target}, which does not exist"
    named = [p.name for p in (REPO / "benchmarks" / "results").iterdir() if "session" in p.name]
    assert not named, f"session-named files among the current results (move them to archive/): {named}"
