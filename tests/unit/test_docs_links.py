"""The docs stay true to the tree: links resolve, shown commands exist, metric names exist.

- every relative link in README.md and docs/*.md points to an existing file;
- every ``metalguard <subcommand> ...`` shown in code (fenced blocks, inline code) is a
  path of the argparse tree built by ``controller.cli.build_parser``;
- every ``metalguard_*`` metric name in the docs is defined in agent/, controller/ or
  proto/ (a histogram's ``_bucket`` / ``_sum`` / ``_count`` series included);
- README.md links every file of docs/ exactly once.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from metalguard.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(\s*)(```|~~~)")
_INLINE = re.compile(r"(`+)(.+?)\1")
# `metalguard` at the start of a command: line/span start, after a path (.venv/bin/),
# a prompt, a shell operator, sudo/exec or a systemd ExecStart=.
_COMMAND = re.compile(
    r"(?:^|/|\$ |&& |; |\| |\$\(|\bdo |\bsudo |\bexec |ExecStart=)metalguard"
    r"((?: +[a-z][a-z0-9-]*)*)"
)
_METRIC = re.compile(r"\bmetalguard_[a-z0-9_]+\b")
_METRIC_SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_texts(markdown: str) -> Iterator[str]:
    """The code in a markdown text: each line of fenced blocks, then each inline span."""
    in_fence = False
    prose: list[str] = []
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            yield line.split(" #", 1)[0].strip()
        else:
            prose.append(line)
    # Inline spans may not cross paragraphs; joining lines keeps spans wrapped mid-span.
    for paragraph in "\n".join(prose).split("\n\n"):
        for match in _INLINE.finditer(paragraph.replace("\n", " ")):
            yield match.group(2).strip()


def shown_commands(markdown: str) -> list[list[str]]:
    """Word sequences following ``metalguard`` where the docs show it as a command."""
    found = []
    for code in code_texts(markdown):
        for match in _COMMAND.finditer(code):
            words = match.group(1).split()
            if words:
                found.append(words)
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:  # argparse keeps its tree here only
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def check_command(root: argparse.ArgumentParser, words: list[str]) -> str | None:
    """None when ``metalguard <words...>`` walks the parser tree, else the problem.

    Words are followed while the current level has subcommands; the first word after a
    leaf command is its argument (``metalguard node NAME``) and is not checked.
    """
    parser = root
    path = ["metalguard"]
    for word in words:
        choices = _subparsers(parser)
        if choices is None:
            return None
        if word not in choices:
            return f"`{' '.join(path)}` has no subcommand {word!r} (has: {', '.join(choices)})"
        parser = choices[word]
        path.append(word)
    return None


def _relative_links(markdown: str) -> Iterator[str]:
    text = "\n".join(
        line for line in _strip_fences(markdown.splitlines())
    )  # links inside code blocks are not links
    for regex in (_LINK, _IMAGE):
        for match in regex.finditer(text):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http:, mailto:, in-page anchors
            yield target


def _strip_fences(lines: list[str]) -> Iterator[str]:
    in_fence = False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield line


def _metric_names_in_code() -> set[str]:
    names: set[str] = set()
    for package in ("agent", "controller", "proto", "metalguard/runtime"):
        for source in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](metalguard_[a-z0-9_]+)[\"']", source.read_text()))
    return names


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_relative_links_point_to_existing_files(doc: Path) -> None:
    broken = []
    for target in _relative_links(doc.read_text()):
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_doc_id(doc)}: links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_shown_commands_exist_in_the_cli(doc: Path) -> None:
    root = build_parser()
    problems = {
        problem
        for words in shown_commands(doc.read_text())
        if (problem := check_command(root, words)) is not None
    }
    assert not problems, f"{_doc_id(doc)}: {sorted(problems)}"


def test_readme_links_every_doc_once() -> None:
    readme_links = list(_relative_links((ROOT / "README.md").read_text()))
    counts = {
        doc.name: sum(1 for t in readme_links if t.split("#", 1)[0] == f"docs/{doc.name}")
        for doc in DOC_FILES[1:]
    }
    wrong = {name: n for name, n in counts.items() if n != 1}
    assert not wrong, f"README.md's doc list must link each doc once: {wrong}"


def test_metric_names_in_docs_exist_in_the_code() -> None:
    defined = _metric_names_in_code()
    assert "metalguard_nodes" in defined, "the scan of the code found no metric: it is broken"
    unknown = {
        f"{_doc_id(doc)}: {name}"
        for doc in DOC_FILES
        for name in unknown_metrics(doc.read_text(), defined)
    }
    assert not unknown, sorted(unknown)


def unknown_metrics(text: str, defined: set[str]) -> list[str]:
    """``metalguard_*`` names in ``text`` that are neither defined nor a defined
    histogram's series."""
    unknown = []
    for name in _METRIC.findall(text):
        base = next((name[: -len(s)] for s in _METRIC_SUFFIXES if name.endswith(s)), name)
        if name not in defined and base not in defined:
            unknown.append(name)
    return unknown


# The checks themselves must be able to fail.


def test_check_command_rejects_unknown_subcommands() -> None:
    root = build_parser()
    assert check_command(root, ["agent", "collect"]) is None
    assert check_command(root, ["agent", "qos", "apply"]) is None
    assert check_command(root, ["node", "r1.c1.n1"]) is None  # a leaf's argument
    assert check_command(root, ["nodez"]) is not None
    assert check_command(root, ["agent", "colect"]) is not None
    assert check_command(root, ["creds", "add-nodes"]) is not None


def test_commands_are_found_in_code_only() -> None:
    text = (
        "metalguard keeps nodes healthy; `metalguard nodes --format json`.\n\n"
        "```sh\n$ .venv/bin/metalguard agent collect --once   # comment metalguard x\n"
        "metalguard demo --headless\n```\n\n"
        "`sacctmgr modify user metalguard set adminlevel=operator`\n"
    )
    assert sorted(shown_commands(text)) == [["agent", "collect"], ["demo"], ["nodes"]]


def test_links_skip_urls_anchors_and_code(tmp_path: Path) -> None:
    text = (
        "[a](docs/a.md) [b](https://example.org/x) [c](#anchor) ![d](img/d.png)\n"
        "```\n[e](not/a/link.md)\n```\n"
    )
    assert list(_relative_links(text)) == ["docs/a.md", "img/d.png"]


def test_unknown_metric_names_are_found() -> None:
    defined = {"metalguard_nodes", "metalguard_decision_latency_seconds"}
    text = (
        "`metalguard_nodes{grade}`, metalguard_decision_latency_seconds_bucket, "
        "metalguard_nodez, metalguard_nodes_bucket_total"
    )
    assert unknown_metrics(text, defined) == ["metalguard_nodez", "metalguard_nodes_bucket_total"]
