"""The layering contracts of pyproject.toml (``lint-imports`` in ``make test``): the tree
keeps them, and each breaks when a forbidden import is added to the import graph, also a
standard-library one (asyncio, subprocess, socket) and an indirect one."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import grimp
import importlinter.api  # noqa: F401  (configures import-linter's settings)
import pytest
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.independence import IndependenceContract
from importlinter.domain.contract import Contract

ROOT = Path(__file__).resolve().parents[2]
CONFIG: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "importlinter"
]
KINDS: dict[str, type[Contract]] = {
    "forbidden": ForbiddenContract,
    "independence": IndependenceContract,
}
INDEPENDENCE = "agent and controller never import each other"
PROTO = "proto (the wire contract) imports no agent, controller, demo, cli"
PURE = "the pure core imports no nats, aiohttp, asyncio, subprocess, socket"
DEMO = "the demo (and its simulated fleet) is imported by no agent, controller, proto"
CLI = "nothing imports metalguard.cli, the composition root"
RUNTIME = "runtime (shared by both) imports no agent, controller, demo, cli"
TWIN = "the fleet twin is imported by no agent, controller, proto, demo"


def contract(name: str) -> Contract:
    """The pyproject.toml contract of that name."""
    (options,) = [c for c in CONFIG["contracts"] if c["name"] == name]
    session = {
        "root_packages": [CONFIG["root_package"]],
        "include_external_packages": CONFIG["include_external_packages"],
    }
    rest = {k: v for k, v in options.items() if k not in ("name", "type")}
    return KINDS[options["type"]](name, session, rest)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        CONFIG["root_package"],
        include_external_packages=CONFIG["include_external_packages"],
        cache_dir=None,
    )


def test_the_tree_keeps_every_contract(graph: grimp.ImportGraph) -> None:
    names = [c["name"] for c in CONFIG["contracts"]]
    assert sorted(names) == sorted([INDEPENDENCE, PROTO, PURE, DEMO, CLI, RUNTIME, TWIN])
    broken = [n for n in names if not contract(n).check(graph, verbose=False).kept]
    assert broken == []


@pytest.mark.parametrize(
    ("importer", "imported", "name"),
    [
        ("metalguard.controller.region", "metalguard.agent.config", INDEPENDENCE),
        ("metalguard.agent.service", "metalguard.controller.config", INDEPENDENCE),
        ("metalguard.proto.codec", "metalguard.controller.config", PROTO),
        ("metalguard.proto.topology", "metalguard.cli", PROTO),
        ("metalguard.controller.core.rail", "nats", PURE),
        ("metalguard.controller.core.decide", "asyncio", PURE),
        ("metalguard.agent.collectors.smart_parse", "subprocess", PURE),
        ("metalguard.agent.events", "socket", PURE),
        ("metalguard.controller.jobs.scheduler", "aiohttp", PURE),
        ("metalguard.agent.qos.plan", "subprocess", PURE),
        ("metalguard.controller.core.topology", "metalguard.controller.state.store", PURE),
        ("metalguard.agent.batch", "metalguard.agent.collection", PURE),
        ("metalguard.controller.service", "metalguard.demo.run", DEMO),
        ("metalguard.agent.config", "metalguard.demo.sim.fleet", DEMO),
        ("metalguard.demo.run", "metalguard.cli", CLI),
        ("metalguard.runtime.looplag", "metalguard.controller.config", RUNTIME),
        ("metalguard.runtime.looplag", "metalguard.agent.config", RUNTIME),
        ("metalguard.controller.jobs.manager", "metalguard.twin.model", TWIN),
        ("metalguard.demo.run", "metalguard.twin.report", TWIN),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    graph: grimp.ImportGraph, importer: str, imported: str, name: str
) -> None:
    assert not graph.chain_exists(importer, imported)
    changed = copy.deepcopy(graph)
    changed.add_import(importer=importer, imported=imported)
    assert not contract(name).check(changed, verbose=False).kept
