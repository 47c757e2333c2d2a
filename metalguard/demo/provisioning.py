"""Provisioning in ``metalguard demo`` (docs/demo.md "Provisioning"): the first region's
real :class:`~metalguard.controller.provision.manager.ProvisionService` (its KV records,
state machine, events and boot server) over the simulated BMC and storage of
:mod:`metalguard.demo.sim.provision`, every node of the region provisionable (a MAC
each), the base image ``demo-base`` registered, and the scenario's ``[[provision]]``
steps taken when due, as the API would take them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.provision.manager import NodeRecords, ProvisionError
from metalguard.demo.sim.provision import SimProvisioning, sim_mac
from metalguard.demo.sim.scenario import Scenario, ScenarioProvision, due_provision
from metalguard.proto.provision import Instance, InstanceRequest
from metalguard.proto.subjects import Subjects

BASE_IMAGE = "demo-base"
BOOT_DELAY_S = 1.5
"""From a simulated node's power cycle to its ready report."""
DEPLOY_TIMEOUT_S = 20.0
TICK_S = 0.5
_CLUSTER = re.compile(r"^r\d+c(\d+)k\d+n\d+$")


def demo_handles(region: str, names: Iterable[str]) -> dict[str, str]:
    """Node name -> handle (``r1c2k3n4`` -> ``r1.c2.r1c2k3n4``) of a simulated fleet."""
    out = {}
    for name in names:
        m = _CLUSTER.match(name)
        if m is not None:
            out[name] = f"{region}.c{m.group(1)}.{name}"
    return out


async def start_provisioning(
    nc: Client,
    js: JetStreamContext,
    subjects: Subjects,
    region: str,
    nodes: NodeRecords,
    handles: Mapping[str, str],
    image_dir: Path,
) -> SimProvisioning:
    """The region's provisioning over simulated hardware, every node given a MAC, and the
    base image registered (built, in the simulation, from ``image_dir``)."""
    macs = {handle: sim_mac(i) for i, handle in enumerate(sorted(handles.values()), 1)}
    sim = await SimProvisioning.start(
        nc,
        js,
        subjects,
        region,
        nodes,
        macs,
        boot_delay_s=BOOT_DELAY_S,
        deploy_timeout_s=DEPLOY_TIMEOUT_S,
        tick_s=TICK_S,
    )
    await sim.service.add_image_from_dir(BASE_IMAGE, str(image_dir), 0)
    return sim


async def take_step(
    sim: SimProvisioning, step: ScenarioProvision, handles: Mapping[str, str]
) -> Instance:
    """Ask the service for one ``[[provision]]`` step; ProvisionError when it refuses."""
    service = sim.service
    if step.action == "create":
        node = handles.get(step.node, step.node) if step.node else ""
        req = InstanceRequest(
            tenant=step.tenant,
            image=step.image,
            node=node,
            volume=step.volume,
            instance_id=step.instance,
        )
        return await service.create(req)
    if step.action == "switch":
        return await service.switch(step.instance, step.tenant, step.image, step.volume)
    if step.action == "release":
        return await service.release(step.instance, step.keep_volume)
    return await service.replace(step.instance)


async def play_provision(
    sim: SimProvisioning,
    scenario: Scenario,
    handles: Mapping[str, str],
    elapsed: Callable[[], float],
    say: Callable[[str], None],
    steps: list[dict[str, Any]],
) -> None:
    """Take the scenario's ``[[provision]]`` steps when due; each is recorded in
    ``steps`` (``t``, ``action``, ``instance``, ``ok``, ``message``)."""
    done: set[int] = set()
    while len(done) < len(scenario.provision):
        for index, step in due_provision(scenario, elapsed(), done):
            done.add(index)
            t = elapsed()
            try:
                inst = await take_step(sim, step, handles)
            except ProvisionError as exc:
                say(f"[{t:6.1f}s] provision {step.action} {step.instance} refused: {exc.message}")
                steps.append(_step(t, step, ok=False, message=exc.message))
                continue
            where = inst.node.rsplit(".", 1)[-1] or "-"
            message = f"{inst.state} on {where} (tenant {inst.tenant}, volume {inst.volume})"
            say(f"[{t:6.1f}s] provision {step.action} {step.instance}: {message}")
            steps.append(_step(t, step, ok=True, message=message))
        await asyncio.sleep(TICK_S)


def _step(t: float, step: ScenarioProvision, *, ok: bool, message: str) -> dict[str, Any]:
    return {"t": t, "action": step.action, "instance": step.instance, "ok": ok, "message": message}
