"""The tests' own house rules, read from their source (AST, nothing imported):

- tests/unit and tests/integration hold only test_*.py, conftest.py and __init__.py, and
  tests/ itself no module but conftest.py and __init__.py: what several files share lives
  in tests/support (tests/support/harness for the integration tests' processes, servers
  and VMs), fixtures in the directory's conftest.py; tests/support holds no tests;
- no test module imports from another ``test_*`` module;
- helper modules define no fixtures (they go in the directory's conftest.py);
- tests/unit needs no root, no subprocess and no server: its modules import nothing that
  starts a process, opens a socket, joins a network namespace or serves HTTP, and ask for
  none of the nats-server fixtures (tests/integration/conftest.py's, out of their reach);
  nor do the tests.* modules they import, followed to the end (unit tests that imported
  the top conftest.py as a library once pulled in the nats-server that way), the
  conftest.py files every unit test loads, and the pure helpers of tests/support (not its
  harness/).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
UNIT = TESTS / "unit"
INTEGRATION = TESTS / "integration"
SUPPORT = TESTS / "support"
HARNESS = SUPPORT / "harness"

TEST_DIRECTORY_FILES = {"conftest.py", "__init__.py"}
"""Beside the test_*.py files, what tests/unit and tests/integration may hold."""

FORBIDDEN_IN_UNIT = {
    "subprocess": "starts processes",
    "asyncio.subprocess": "starts processes",
    "multiprocessing": "starts processes",
    "socket": "opens sockets",
    "socketserver": "serves on a socket",
    "http.server": "serves HTTP",
    "pyroute2": "netlink and network namespaces (root)",
    "selenium": "drives a browser",
    "metalguard.controller.broker.server": "starts a nats-server",
}
"""Modules (and their submodules) a unit test module must not import, and why."""

EXACTLY_FORBIDDEN_IN_UNIT = {"nats": "connects to a server (nats.connect)"}
"""Modules forbidden themselves only: nats.aio.client, nats.errors, nats.js.api (types and
errors for the fakes) are fine."""

FORBIDDEN_NAMES_IN_UNIT = {
    "aiohttp.test_utils": {"TestServer", "TestClient", "RawTestServer", "unused_port"},
    "aiohttp.web": {"AppRunner", "TCPSite", "UnixSite", "SockSite", "run_app"},
    "asyncio": {
        "create_subprocess_exec",
        "create_subprocess_shell",
        "start_server",
        "start_unix_server",
        "open_connection",
        "open_unix_connection",
    },
    "os": {"system", "popen", "fork", "posix_spawn", "posix_spawnp", "execv", "execvp", "geteuid"},
}
"""Names of a module (imported, or used as ``module.name``) that start a process or a server,
open a connection or ask whether we are root (make_mocked_request, web.Response: fine)."""

ATTRIBUTE_ALIASES = {"web": "aiohttp.web", "asyncio": "asyncio", "os": "os"}

SERVER_FIXTURES = {"nats_server", "nats_url", "nc", "subjects", "fresh_server"}
"""tests/integration/conftest.py's fixtures of the session nats-server."""

UNIT_ALLOWED = {
    # socket.socketpair() stands in for the kernel's uevent netlink fd: an in-process pair
    # of descriptors, nothing binds, listens or connects.
    "support/uevent_monitor.py": {"socket"},
}
"""Per module (its path under tests/), the forbidden modules it may import all the same."""


def test_test_directories_hold_only_tests() -> None:
    """Helpers (and their data: scripts, C sources) live in tests/support, not among the
    tests; tests/ itself holds no helper module either."""
    found = [
        f"{entry.relative_to(TESTS.parent)}"
        for directory in (UNIT, INTEGRATION)
        for entry in sorted(directory.iterdir())
        if entry.name != "__pycache__"
        and not (entry.is_file() and entry.suffix == ".py" and entry.name.startswith("test_"))
        and entry.name not in TEST_DIRECTORY_FILES
    ]
    found += [
        f"{path.relative_to(TESTS.parent)}"
        for path in sorted(TESTS.glob("*.py"))
        if path.name not in TEST_DIRECTORY_FILES
    ]
    found += [
        f"{path.relative_to(TESTS.parent)} (tests go in tests/unit or tests/integration)"
        for path in sorted(SUPPORT.rglob("*.py"))
        if path.name.startswith("test_") or path.name == "conftest.py"
    ]
    assert not found, (
        "tests/unit and tests/integration hold only test_*.py, conftest.py and __init__.py; "
        "move helpers to tests/support (tests/support/harness: processes, servers, VMs):\n"
        + "\n".join(found)
    )


def python_files(root: Path) -> Iterator[Path]:
    """The .py files of the tests (not the fixture trees)."""
    for path in sorted(root.rglob("*.py")):
        if "fixtures" not in path.relative_to(root).parts:
            yield path


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_modules(path: Path, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import; ``from x import y`` gives x and x.y."""
    package = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def is_fixture(decorator: ast.expr) -> bool:
    """``@pytest.fixture``, ``@pytest.fixture(...)``, ``@fixture``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return bool(name == "fixture")


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(TESTS.parent)}:{line}"


def imports_of_test_modules(path: Path, tree: ast.Module) -> Iterator[str]:
    """The imports in ``tree`` (the module ``path``) of a ``test_*`` module."""
    for line, module in imported_modules(path, tree):
        parts = module.split(".")
        if parts[0].startswith("test_") or (
            parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:])
        ):
            yield f"{where(path, line)} imports {module}"


def test_no_test_module_imports_from_another_test_module() -> None:
    found = [v for path in python_files(TESTS) for v in imports_of_test_modules(path, parse(path))]
    assert not found, (
        "import shared helpers from a helper module (not test_*.py) and fixtures through the "
        "directory's conftest.py:\n" + "\n".join(found)
    )


def test_the_import_check_finds_test_modules_however_imported() -> None:
    source = (
        "from tests.integration.test_jobs_e2e import jobs_env\n"
        "from .test_ha import TTL_S\n"
        "from . import test_api\n"
        "import tests.unit.test_scoring\n"
        "from tests.support.harness.jobs_env import JobsEnv\n"
        "from tests.support import scoring_helpers\n"
    )
    found = list(imports_of_test_modules(TESTS / "integration" / "probe.py", ast.parse(source)))
    assert [f.split(" imports ")[1] for f in found] == [
        "tests.integration.test_jobs_e2e",
        "tests.integration.test_jobs_e2e.jobs_env",
        "tests.integration.test_ha",
        "tests.integration.test_ha.TTL_S",
        "tests.integration.test_api",
        "tests.unit.test_scoring",
    ]


def test_helper_modules_define_no_fixtures() -> None:
    found = [
        f"{where(path, node.lineno)} defines the fixture {node.name}"
        for path in python_files(TESTS)
        if not path.name.startswith("test_") and path.name != "conftest.py"
        for node in ast.walk(parse(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(is_fixture(d) for d in node.decorator_list)
    ]
    assert not found, "fixtures go in the directory's conftest.py:\n" + "\n".join(found)


def unit_violations(path: Path, tree: ast.Module) -> Iterator[str]:
    """What in ``tree`` (the module ``path`` of tests/unit) needs a process, a socket, root
    or a server."""
    allowed = UNIT_ALLOWED.get(path.relative_to(TESTS).as_posix(), set())
    for line, module in imported_modules(path, tree):
        for forbidden, why in FORBIDDEN_IN_UNIT.items():
            if forbidden not in allowed and (
                module == forbidden or module.startswith(forbidden + ".")
            ):
                yield f"{where(path, line)} imports {module}: {why}"
        if module in EXACTLY_FORBIDDEN_IN_UNIT and module not in allowed:
            yield f"{where(path, line)} imports {module}: {EXACTLY_FORBIDDEN_IN_UNIT[module]}"
        parent, _, name = module.rpartition(".")
        if name in FORBIDDEN_NAMES_IN_UNIT.get(parent, set()):
            yield f"{where(path, line)} imports {module}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = ATTRIBUTE_ALIASES.get(node.value.id, "")
            if node.attr in FORBIDDEN_NAMES_IN_UNIT.get(module, set()):
                yield f"{where(path, node.lineno)} uses {node.value.id}.{node.attr}"
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "root"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
        ):
            yield f"{where(path, node.lineno)} is marked root"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            wanted = {a.arg for a in node.args.args} & SERVER_FIXTURES
            takes_fixtures = node.name.startswith("test_") or any(
                map(is_fixture, node.decorator_list)
            )
            if wanted and takes_fixtures:
                yield f"{where(path, node.lineno)} {node.name} asks for {sorted(wanted)}"


def test_unit_tests_need_no_process_socket_root_or_server() -> None:
    found = [v for path in python_files(UNIT) for v in unit_violations(path, parse(path))]
    assert not found, (
        "tests/unit holds only tests that need no root, no subprocess and no server: move "
        "these to tests/integration (with their fixtures):\n" + "\n".join(found)
    )


def test_the_unit_check_finds_what_it_forbids() -> None:
    """The check above, shown on a module that breaks each rule once."""
    source = (
        "import subprocess\n"
        "import nats\n"
        "import nats.errors\n"
        "from aiohttp.test_utils import TestServer, make_mocked_request\n"
        "import asyncio\n"
        "import pytest\n"
        "@pytest.mark.root\n"
        "async def test_x(nc):\n"
        "    await asyncio.create_subprocess_exec('true')\n"
    )
    found = list(unit_violations(UNIT / "test_probe.py", ast.parse(source)))
    assert len(found) == 6, found
    for what in (
        "imports subprocess",
        "imports nats:",
        "imports aiohttp.test_utils.TestServer",
        "uses asyncio.create_subprocess_exec",
        "is marked root",
        "test_x asks for ['nc']",
    ):
        assert any(what in f for f in found), (what, found)


def module_files(module: str) -> Iterator[Path]:
    """The files that importing ``module`` runs, when it is one of tests.*: its packages'
    __init__.py files and the module itself (nothing for a name inside a module)."""
    parts = module.split(".")
    if parts[0] != "tests":
        return
    for end in range(1, len(parts) + 1):
        base = TESTS.parent.joinpath(*parts[:end])
        if (base / "__init__.py").is_file():
            yield base / "__init__.py"
        elif base.with_suffix(".py").is_file():
            yield base.with_suffix(".py")
        else:
            return


def reached(path: Path, tree: ast.Module) -> dict[Path, list[Path]]:
    """Every tests.* module that importing ``tree`` (the module ``path``) runs, followed to
    the end, each with the chain of imports that first reaches it (``path`` left out)."""
    chains: dict[Path, list[Path]] = {path: []}
    queue = [(path, tree)]
    while queue:
        module_path, module_tree = queue.pop(0)
        for _, module in imported_modules(module_path, module_tree):
            for file in module_files(module):
                if file not in chains:
                    chains[file] = [*chains[module_path], file]
                    queue.append((file, parse(file)))
    del chains[path]
    return chains


def reached_violations(path: Path, tree: ast.Module) -> Iterator[str]:
    """What the tests.* modules that ``tree`` (the module ``path``) imports, directly or
    through each other, do that a unit test must not."""
    for module, chain in reached(path, tree).items():
        via = " -> ".join(str(p.relative_to(TESTS.parent)) for p in chain)
        for violation in unit_violations(module, parse(module)):
            yield f"{path.relative_to(TESTS.parent)} reaches {via}: {violation}"


def must_be_pure() -> Iterator[Path]:
    """The modules held to the unit tests' rules, with all they import: tests/unit's,
    the conftest.py and __init__.py above them, and tests/support's pure helpers."""
    yield from python_files(UNIT)
    yield TESTS / "__init__.py"
    yield TESTS / "conftest.py"
    yield from sorted(SUPPORT.glob("*.py"))


def test_unit_tests_reach_no_process_socket_root_or_server_through_helpers() -> None:
    found: list[str] = []
    for path in must_be_pure():
        tree = parse(path)
        if UNIT not in path.parents:  # tests/unit's own: test_unit_tests_need_no_...
            found += unit_violations(path, tree)
        found += reached_violations(path, tree)
    assert not found, (
        "a unit test (or a pure helper of tests/support, or a conftest.py every unit test "
        "loads) reaches, through the tests.* modules it imports, one that needs a process, "
        "a socket, root or a server: import what the test needs from a pure module, or "
        "move the test to tests/integration:\n" + "\n".join(found)
    )


def test_the_transitive_check_follows_helpers_to_the_end() -> None:
    """The check above, shown on a unit test that imports a harness of tests/support (pure
    itself, its imports are not) and a pure helper."""
    source = (
        "from tests.support.harness.bmc_client import target\n"
        "from tests.support import clock\n"
        "import tests.support.scoring_helpers\n"
    )
    probe = UNIT / "test_probe.py"
    chains = reached(probe, ast.parse(source))
    bmc_client = HARNESS / "bmc_client.py"
    emulator = HARNESS / "redfish_emulator.py"
    assert chains[bmc_client] == [bmc_client]
    assert chains[emulator] == [bmc_client, emulator]
    assert chains[HARNESS / "__init__.py"] == [HARNESS / "__init__.py"]
    assert SUPPORT / "clock.py" in chains
    assert SUPPORT / "scoring_helpers.py" in chains
    found = list(reached_violations(probe, ast.parse(source)))
    assert found
    assert all("harness/redfish_emulator.py" in f for f in found), found
    assert any(
        "reaches tests/support/harness/bmc_client.py -> tests/support/harness/"
        "redfish_emulator.py: tests/support/harness/redfish_emulator.py:"
        in f
        and "imports subprocess: starts processes" in f
        for f in found
    ), found
