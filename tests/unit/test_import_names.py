"""One import namespace: no Python file of the project imports the old top-level names
``agent``, ``controller`` or ``proto`` (only ``metalguard.agent``, ...), nor names a module
by them in a string: a logger (``caplog``'s ``logger=``, ``logging.getLogger``), a
``monkeypatch.setattr``/``mock.patch`` target, ``importlib.import_module``,
``python -m ...`` or the code given to ``python -c``. Read from the source (AST), every
file once: metalguard/'s symlinks to agent/, controller/ and proto/ are not followed.
"""

from __future__ import annotations

import ast
import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("agent", "controller", "proto", "metalguard", "tests", "bench", "examples")
OLD = frozenset({"agent", "controller", "proto"})
MODULE_ARGUMENT_CALLS = frozenset(
    {"getLogger", "setattr", "patch", "import_module", "importorskip", "find_spec", "delattr"}
)
"""Calls whose first argument, a string, may name a module (monkeypatch.setattr("a.b.c"))."""
DOTTED = re.compile(r"[A-Za-z_]\w*(\.\w+)*")
ALLOWED = {
    # proto-plus's own import name, imported beside metalguard.proto on purpose in the
    # installed venv (the acceptance test that the two no longer collide)
    "tests/integration/test_packaging.py": {"proto"},
}


def python_files() -> Iterator[Path]:
    """Every .py file of TREES, each once: no symlinked folder or file is followed."""
    for tree in TREES:
        for folder, dirs, files in os.walk(ROOT / tree):  # followlinks=False
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                path = Path(folder) / name
                if name.endswith(".py") and not path.is_symlink():
                    yield path


def is_old(module: str) -> bool:
    return module.split(".")[0] in OLD


def code_imports(text: str) -> Iterator[str]:
    """The modules a string imports when it is Python code (``python -c``), else none."""
    if "import" not in text:
        return
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return  # prose, a template, a shell script
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def old_names(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, how, name) for each use of an old top-level name in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_old(alias.name):
                    yield node.lineno, "import", alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if is_old(node.module):
                yield node.lineno, "from", node.module
        elif isinstance(node, ast.Call):
            yield from _call_names(node)
        elif isinstance(node, ast.List | ast.Tuple):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, module in itertools.pairwise(items):
                if flag == "-m" and isinstance(module, str) and is_old(module):
                    yield node.lineno, "python -m", module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for imported in code_imports(node.value):
                if is_old(imported):
                    yield node.lineno, "code in a string", imported


def _call_names(node: ast.Call) -> Iterator[tuple[int, str, str]]:
    """A module named by a call's first argument (getLogger("..."), ...) or ``logger=``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    first = node.args[0] if node.args and name in MODULE_ARGUMENT_CALLS else None
    loggers = [k.value for k in node.keywords if k.arg == "logger"]
    for arg in [first, *loggers]:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            continue
        if DOTTED.fullmatch(arg.value) and is_old(arg.value):
            yield node.lineno, name if arg is first else "logger", arg.value


def test_every_tree_is_read() -> None:
    files = {p.relative_to(ROOT).parts[0] for p in python_files()}
    assert files == set(TREES)
    assert not any(p.is_relative_to(ROOT / "metalguard" / "agent") for p in python_files())


def test_nothing_imports_or_names_the_old_top_level_packages() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {how} {name}"
        for path in python_files()
        for line, how, name in old_names(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if name not in ALLOWED.get(path.relative_to(ROOT).as_posix(), set())
    ]
    assert not found, "use metalguard.agent, metalguard.controller, metalguard.proto:\n" + (
        "\n".join(found)
    )


def test_the_check_finds_each_form() -> None:
    source = (ROOT / "tests" / "fixtures" / "import_names" / "probe.py.txt").read_text()
    found = [(line, how, name) for line, how, name in sorted(old_names(ast.parse(source)))]
    assert found == [
        (3, "import", "agent.config"),
        (5, "from", "controller.api"),
        (8, "logger", "controller.ingest.consumer"),
        (10, "getLogger", "proto.codec"),
        (11, "setattr", "agent.service.run"),
        (13, "python -m", "controller"),
        (14, "code in a string", "agent.collectors"),
        (15, "code in a string", "proto.codec"),
    ], found
