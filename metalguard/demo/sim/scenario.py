"""Scenario files: which faults hit which simulated nodes, and when.

A scenario is TOML::

    description = "one of each"

    [[fault]]
    at = 30          # seconds after the fleet starts
    node = "r1c1k2n3"
    kind = "ecc_ue"  # one of faults.KNOWN_KINDS (docs/simulation.md "Faults")
    count = 1        # optional: errors per application (per tick for ecc_ce_storm,
                     # rdma_symbol_errors, dcqcn_no_cnp; flaps for rdma_link_flap)
    duration_s = 60  # optional: how long a storm (symbol errors, ECN marks, a port down) lasts
    expect = "FAILING"  # optional: the grade the controller should give the node

    [[job]]          # optional: a training job submitted at `at` (docs/jobs.md)
    at = 5
    name = "llm-a"
    nodes = 4
    args = ["examples/trainer.py", "--steps", "1200"]
    checkpoint_every = 5
    region = "r1"    # optional: the region whose job manager runs it (default: the first)

    [[provision]]    # optional: a provisioning step at `at` (docs/provisioning.md)
    at = 8
    action = "create"  # create | switch | release | replace
    instance = "acme-1"
    tenant = "acme"    # create, switch
    image = "demo-base"  # create, switch (the demo registers "demo-base")
    node = "r1c1k4n1"  # create: optional (default: any available node of region r1)
    expect = "active"  # optional: the instance's state at the end of the run

Errors name the file, the key and the problem, like every other document here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from metalguard.demo.sim.faults import KNOWN_KINDS
from metalguard.proto.base import Token
from metalguard.proto.documents import DocumentError, load_document
from metalguard.proto.nodes import Grade
from metalguard.proto.provision import InstanceState


class ScenarioError(DocumentError):
    """The scenario file is unreadable or invalid; the message names file, key, problem."""


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[fault]]`` entry."""

    at: Annotated[float, msgspec.Meta(ge=0)]
    node: Token
    kind: str
    count: Annotated[int, msgspec.Meta(ge=1)] | None = None
    duration_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    expect: Grade | None = None
    """The grade the controller should give the node (the demo report checks it)."""
    line: str = ""
    """``kind = "kmsg"``: the line the node's kernel logs (its simulated kernel log,
    which the node's agent reads as /dev/kmsg; docs/kmsg.md)."""
    slowdown: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """``kind = "straggler"``: how much slower the node's training processes compute
    (0.3: 30 %; default 0.3), for ``duration_s`` (default: to the end)."""


class ScenarioJob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[job]]`` entry: a training job the demo submits at ``at`` (docs/jobs.md).

    Relative paths in ``args`` that exist where the demo runs are made absolute.
    """

    at: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    name: Annotated[str, msgspec.Meta(min_length=1)]
    nodes: Annotated[int, msgspec.Meta(ge=1)] = 1
    priority: int = 0
    preemptible: bool = False
    command: str = "python"
    args: tuple[str, ...] = ()
    checkpoint_every: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    hang_timeout: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """None: the job manager's default (docs/jobs.md); 0: off."""
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    timing_window_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """The window of the ranks' step timings (docs/jobs.md "Stragglers"); a demo packs
    minutes into seconds and may shorten it."""
    region: str = ""
    """The region whose job manager runs it (``r2``); empty: the demo's first region."""


ProvisionAction = Literal["create", "switch", "release", "replace"]


class ScenarioProvision(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[provision]]`` entry: a step the demo asks of region r1's provisioning
    service at ``at`` (docs/provisioning.md), as the API would."""

    at: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    action: ProvisionAction
    instance: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")]
    tenant: str = ""
    """create, switch: the tenant."""
    image: str = ""
    """create, switch: the base image (the demo registers ``demo-base``)."""
    node: str = ""
    """create: a node name of the fleet (``r1c1k4n1``), or "" for any available node."""
    volume: str = ""
    """create, switch: an existing volume of the tenant to boot."""
    keep_volume: bool = True
    """release: keep the tenant's volume (false: delete it)."""
    expect: InstanceState | None = None
    """The instance's state at the end of the run (the demo report checks it)."""

    def __post_init__(self) -> None:
        if self.action in ("create", "switch") and not (self.tenant and self.image):
            raise ValueError(f"a {self.action} needs a tenant and an image")


class Scenario(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole scenario file."""

    description: str = ""
    rail_max_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    """The safety rail of the demo's controllers (docs/lifecycle.md): the share of a
    cluster automatic isolation may take an hour. None: the controller's default (10 %).
    A scenario packs hours of faults into a minute and may widen it to show them all."""
    fault: tuple[Fault, ...] = ()
    job: tuple[ScenarioJob, ...] = ()
    provision: tuple[ScenarioProvision, ...] = ()


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    """Parse and validate scenario TOML; ScenarioError naming source, key and problem."""
    return _known_kinds(load_document(text, Scenario, source=source, error=ScenarioError), source)


def load_scenario(path: Path) -> Scenario:
    """Read and parse the scenario file at ``path``."""
    return _known_kinds(load_document(path, Scenario, error=ScenarioError), str(path))


def _known_kinds(scenario: Scenario, source: str) -> Scenario:
    """``scenario``, once every fault's kind is known; ScenarioError naming the first not."""
    for i, fault in enumerate(scenario.fault):
        if fault.kind not in KNOWN_KINDS:
            raise ScenarioError(
                f"{source}: fault[{i}].kind: unknown kind {fault.kind!r}; "
                f"known: {', '.join(KNOWN_KINDS)}"
            )
        if (fault.kind == "kmsg") != bool(fault.line.strip()):
            raise ScenarioError(
                f"{source}: fault[{i}].line: "
                + ("kind 'kmsg' needs the line to log" if fault.kind == "kmsg" else
                   f"only kind 'kmsg' takes a line, not {fault.kind!r}")
            )  # fmt: skip
        if fault.slowdown is not None and fault.kind != "straggler":
            raise ScenarioError(
                f"{source}: fault[{i}].slowdown: only kind 'straggler' takes a slowdown, "
                f"not {fault.kind!r}"
            )
    return scenario


def unknown_nodes(scenario: Scenario, nodes: Iterable[str]) -> list[str]:
    """Nodes the scenario's faults name that are not in ``nodes`` (in file order, once
    each)."""
    known = set(nodes)
    return list(dict.fromkeys(f.node for f in scenario.fault if f.node not in known))


def instances_off(scenario: Scenario, nodes: Iterable[str]) -> list[str]:
    """The instances of the ``[[provision]]`` steps that a create puts on a node not in
    ``nodes`` (their steps cannot be taken), in file order, once each."""
    known = set(nodes)
    return list(
        dict.fromkeys(
            p.instance
            for p in scenario.provision
            if p.action == "create" and p.node and p.node not in known
        )
    )


def due_faults(
    scenario: Scenario, elapsed_s: float, already_applied: Collection[int]
) -> list[tuple[int, Fault]]:
    """The faults due at ``elapsed_s`` not yet applied, as (index, fault), earliest first."""
    due = [
        (i, f)
        for i, f in enumerate(scenario.fault)
        if f.at <= elapsed_s and i not in already_applied
    ]
    return sorted(due, key=lambda item: (item[1].at, item[0]))


def due_provision(
    scenario: Scenario, elapsed_s: float, already_done: Collection[int]
) -> list[tuple[int, ScenarioProvision]]:
    """The ``[[provision]]`` steps due at ``elapsed_s`` not yet taken, earliest first."""
    due = [
        (i, p)
        for i, p in enumerate(scenario.provision)
        if p.at <= elapsed_s and i not in already_done
    ]
    return sorted(due, key=lambda item: (item[1].at, item[0]))


def due_jobs(
    scenario: Scenario, elapsed_s: float, already_submitted: Collection[int]
) -> list[tuple[int, ScenarioJob]]:
    """The ``[[job]]`` entries due at ``elapsed_s`` not yet submitted, earliest first."""
    due = [
        (i, j)
        for i, j in enumerate(scenario.job)
        if j.at <= elapsed_s and i not in already_submitted
    ]
    return sorted(due, key=lambda item: (item[1].at, item[0]))
