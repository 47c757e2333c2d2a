"""A simulated fleet: many real agents in one process and event loop, each over its own
generated sysfs tree, publishing to a real NATS server (docs/simulation.md).

Nodes are named ``r{region}c{cluster}k{rack}n{node}`` (1-based); their identity is
region ``r{region}``, cluster ``c{cluster}``.  Each node gets, under ``root_dir/<name>/``,
``sys/`` and ``smart/`` (the tree), ``spool/`` and ``agent.toml``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from metalguard.agent.config import AgentConfig, parse_config
from metalguard.agent.service import AgentService
from metalguard.demo.sim import gpus
from metalguard.demo.sim.faults import (
    KMSG_FILE,
    RUNNER_KINDS,
    Applied,
    FaultError,
    Process,
    apply_fault,
)
from metalguard.demo.sim.nvml import SimNvml
from metalguard.demo.sim.scenario import Scenario, ScenarioError, due_faults, unknown_nodes
from metalguard.demo.sim.traffic import Traffic
from metalguard.demo.sim.tree import (
    RDMA_RATE_GBPS,
    NodeSpec,
    NodeTree,
    rdma_port_names,
    write_tree,
)
from metalguard.proto.topology import NodeTopology

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
BUILD_THREADS = 8
"""Trees are written by several threads: creating ~20 000 small files is syscall-bound."""
TRAFFIC_EVERY = 5
"""A node's RDMA data counters are advanced every this many ticks (the nodes take turns,
so a tick writes about a fifth of the fleet's counters)."""

RDMA_INTERVAL_FACTOR = 5
"""The rdma collector runs every this many collection intervals (5 s at 1 s, the
collector's own default interval): its scan of a node's ~90 files costs about a third of
the other collectors' together (docs/simulation.md)."""

GPU_INTERVAL_FACTOR = 5
"""The gpu collector (a fleet with simulated NVML) runs every this many intervals, like
rdma: an XID or a GPU reset asks for a reading at once (``AgentService.expedite_gpu``)."""

Fabric = Literal["mixed", "infiniband", "roce"]
"""The RDMA fabric of a fleet's nodes: ``mixed``: racks k1, k3, ... InfiniBand, k2, k4,
... RoCE (a simulation's convenience: both kinds in every fleet)."""


def is_infiniband(rack: int, fabric: Fabric = "mixed") -> bool:
    """Whether the nodes of rack ``rack`` (1-based) have InfiniBand (else RoCE) NICs."""
    return fabric == "infiniband" or (fabric == "mixed" and rack % 2 == 1)


def node_name(region: int, cluster: int, rack: int, node: int) -> str:
    """``r1c1k2n3``: the name of node 3 in rack 2 of cluster 1 of region 1."""
    return f"r{region}c{cluster}k{rack}n{node}"


def fleet_names(region: int, clusters: int, racks: int, nodes_per_rack: int) -> list[str]:
    """Every node name of a fleet, clusters then racks then nodes, all 1-based."""
    return [
        node_name(region, c, k, n)
        for c in range(1, clusters + 1)
        for k in range(1, racks + 1)
        for n in range(1, nodes_per_rack + 1)
    ]


def sim_topology(
    cluster: int,
    rack: int,
    node: int,
    nodes_per_rack: int,
    gpus: int = 8,
    rdma_ports: tuple[str, ...] = (),
) -> NodeTopology:
    """The simulated node's place and capacity (docs/scheduler.md): clusters 1-2 in zone
    z1, 3-4 in z2, ...; racks ``k<rack>``; a leaf per half rack (per rack below 8 nodes);
    ``gpus`` H100s (the tree's), 128 cores, 1024 GB, bandwidth tier 2; the tree's RDMA
    ports cabled, at 400 Gb/s."""
    half = 1 if nodes_per_rack < 8 or node <= nodes_per_rack // 2 else 2
    return NodeTopology(
        zone=f"z{(cluster + 1) // 2}",
        rack=f"k{rack}",
        leaf=f"k{rack}-l{half}",
        gpus=gpus,
        gpu_type="h100",
        cpu_cores=128,
        memory_gb=1024,
        bandwidth_tier=2,
        rdma_ports=rdma_ports,
        rdma_rate_gbps=RDMA_RATE_GBPS if rdma_ports else 0.0,
    )


def toml_value(value: object) -> str:
    """A TOML value for a string, number, bool or tuple of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def topology_toml(topology: NodeTopology) -> str:
    """``[node]`` lines for a topology (appended to the table)."""
    return "".join(
        f"{key} = {toml_value(getattr(topology, key))}\n" for key in topology.__struct_fields__
    )


def node_seed(seed: int, name: str) -> int:
    """A per-node seed: stable across runs and independent of fleet size."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


IOMMU_INTERVAL_FACTOR = 5
"""The iommu collector runs every this many intervals (its own default is 5 min: a
simulated node's posture changes only when a scenario's fault changes it)."""


def agent_config_text(
    *,
    name: str,
    region: str,
    cluster: str,
    tree: NodeTree,
    spool_dir: Path,
    nats_url: str,
    prefix: str,
    interval_s: float,
    topology: NodeTopology | None = None,
    rdma: bool = True,
    gpu: bool = False,
    kmsg: Path | None = None,
) -> str:
    """The agent.toml of one simulated node: its tree, every interval ``interval_s``;
    the ``rdma`` collector too (every :data:`RDMA_INTERVAL_FACTOR` intervals) when the tree
    has RDMA devices; the ``gpu`` collector when the node has simulated NVML."""
    intervals = dict.fromkeys(("edac", "pcie", "hwmon", "smart"), interval_s)
    if rdma:
        intervals["rdma"] = interval_s * RDMA_INTERVAL_FACTOR
    if gpu:  # the collector's own default interval is 5 s: XIDs expedite it
        intervals["gpu"] = interval_s * GPU_INTERVAL_FACTOR
    if tree.iommu:  # the posture changes at boot: collected now and then
        intervals["iommu"] = interval_s * IOMMU_INTERVAL_FACTOR
    collectors = list(intervals)
    interval_lines = "".join(f"{c} = {value}\n" for c, value in intervals.items())
    return f"""\
[node]
region = "{region}"
cluster = "{cluster}"
name = "{name}"
uuid = "sim-{name}"
{topology_toml(topology) if topology is not None else ""}
[nats]
servers = ["{nats_url}"]
prefix = "{prefix}"
connect_timeout_s = 2.0
publish_timeout_s = 5.0
reconnect_base_s = 0.2
reconnect_max_s = 2.0

[collect]
interval_s = {interval_s}
enabled = {toml_value(collectors)}
sysfs = "{tree.sysfs}"
smart_json_dir = "{tree.smart_dir}"
timeout_s = 30.0

[collect.intervals]
{interval_lines}
[spool]
dir = "{spool_dir}"
{kmsg_section(kmsg)}"""


def kmsg_section(path: Path | None) -> str:
    """The ``[kmsg]`` table of a node whose simulated kernel log is ``path`` ("" without
    one): the agent reads it from the start, as its kernel's."""
    if path is None:
        return ""
    return f'\n[kmsg]\nenabled = true\npath = "{path}"\nbackfill_s = 0\n'


@dataclass(slots=True)
class SimNode:
    """One simulated node: its tree, config and (while running) agent."""

    name: str
    tree: NodeTree
    config_path: Path
    config: AgentConfig
    service: AgentService | None = None
    task: asyncio.Task[int] | None = None
    killed: bool = False
    traffic: Traffic | None = None
    nvml: SimNvml | None = None
    """The node's simulated NVML (a fleet with ``nvml=True``)."""


class SimFleet:
    """Generated trees plus one real :class:`AgentService` per node, all in this loop."""

    def __init__(
        self,
        root_dir: Path,
        nats_url: str,
        *,
        region: int = 1,
        clusters: int = 1,
        racks: int = 4,
        nodes_per_rack: int = 8,
        interval_s: float = 1.0,
        prefix: str = "mg",
        seed: int = 0,
        spec: NodeSpec | None = None,
        fabric: Fabric = "mixed",
        clock: Callable[[], float] = time.monotonic,
        nvml: bool = False,
        kmsg: bool = False,
    ) -> None:
        """``nvml``: each node's GPUs are NVIDIA's too, behind a simulated NVML
        (:mod:`demo.sim.nvml`): the agents run the gpu collector and the XID watcher, and
        the ``gpu_*`` faults apply."""
        self.root_dir = Path(root_dir)
        self.nvml = nvml
        self.kmsg = kmsg
        """Each node's agent reads a simulated kernel log (``<node>/kmsg``), which the
        ``kmsg`` fault writes to."""
        self.nats_url = nats_url
        self.region = region
        self.interval_s = interval_s
        self.prefix = prefix
        self.seed = seed
        self.spec = spec or NodeSpec()
        self._clock = clock
        self._rng = random.Random(seed)
        self.node_names = fleet_names(region, clusters, racks, nodes_per_rack)
        places = {
            node_name(region, c, k, n): (c, k, n)
            for c in range(1, clusters + 1)
            for k in range(1, racks + 1)
            for n in range(1, nodes_per_rack + 1)
        }
        self._cluster_of = {name: f"c{c}" for name, (c, _, _) in places.items()}
        self.specs = {
            name: dataclasses.replace(self.spec, infiniband=is_infiniband(k, fabric))
            for name, (_, k, _) in places.items()
        }
        """Each node's hardware: the fleet's spec, InfiniBand or RoCE as ``fabric`` says."""
        self.topology = {
            name: sim_topology(
                c, k, n, nodes_per_rack, self.spec.gpus, rdma_port_names(self.specs[name])
            )
            for name, (c, k, n) in places.items()
        }
        """Each node's place and capacity, written into its agent.toml's ``[node]``."""
        self.nodes: dict[str, SimNode] = {}
        self._ticks = 0
        self.processes: dict[str, list[Process]] = {}
        self.applied: list[tuple[str, Applied]] = []
        self._started_at: float | None = None

    # --- building ---------------------------------------------------------------------
    def _build(self) -> dict[str, SimNode]:
        """Write every node's tree and config (blocking; run in a thread)."""
        nodes: dict[str, SimNode] = {}
        with concurrent.futures.ThreadPoolExecutor(BUILD_THREADS) as pool:
            trees = pool.map(
                lambda name: write_tree(
                    self.root_dir / name, self.specs[name], node_seed(self.seed, name)
                ),
                self.node_names,
            )
        for name, tree in zip(self.node_names, trees, strict=True):
            node_dir = self.root_dir / name
            cluster = self._cluster_of[name]
            text = agent_config_text(
                name=name,
                region=f"r{self.region}",
                cluster=cluster,
                tree=tree,
                spool_dir=node_dir / "spool",
                nats_url=self.nats_url,
                prefix=self.prefix,
                interval_s=self.interval_s,
                topology=self.topology[name],
                rdma=bool(tree.paths.rdma_ports),
                gpu=self.nvml,
                kmsg=self._kmsg_file(node_dir),
            )
            nvml = None
            if self.nvml:
                addresses = [p.rsplit("/", 1)[-1] for p in tree.paths.gpus]
                nvml = SimNvml(gpus.create(node_dir, addresses))
            config_path = node_dir / "agent.toml"
            config_path.write_text(text)
            traffic = Traffic.of(tree, random.Random(node_seed(self.seed, name)))
            config = parse_config(text, str(config_path))
            nodes[name] = SimNode(name, tree, config_path, config, traffic=traffic, nvml=nvml)
        return nodes

    def _kmsg_file(self, node_dir: Path) -> Path | None:
        """A node's simulated kernel log, created empty (None: the fleet has none)."""
        if not self.kmsg:
            return None
        path = node_dir / KMSG_FILE
        path.touch()
        return path

    # --- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Generate the trees and start every agent as a task of the running loop."""
        self.nodes = await asyncio.to_thread(self._build)
        try:
            for node in self.nodes.values():
                node.service = AgentService(node.config_path, node.config, env={}, nvml=node.nvml)
                node.task = asyncio.create_task(node.service.run(), name=f"sim-agent-{node.name}")
        except BaseException:
            await self.stop()
            raise
        self._started_at = self._clock()

    async def stop(self) -> None:
        """Stop every agent that still runs and wait for all of them to end."""
        for node in self.nodes.values():
            if node.service is not None:
                node.service.request_stop()
        tasks = [n.task for n in self.nodes.values() if n.task is not None]
        if not tasks:
            return
        done, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("simulated agent %s failed: %r", task.get_name(), task.exception())

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def elapsed_s(self) -> float:
        """Seconds since :meth:`start` (0 before it)."""
        return 0.0 if self._started_at is None else self._clock() - self._started_at

    def running(self) -> list[str]:
        """Names of the nodes whose agent task is still running."""
        return [n.name for n in self.nodes.values() if n.task is not None and not n.task.done()]

    # --- faults -----------------------------------------------------------------------
    def tree(self, node: str) -> NodeTree:
        """A node's generated tree."""
        try:
            return self.nodes[node].tree
        except KeyError:
            raise FaultError(f"no node {node!r} in the fleet") from None

    def kill_agent(self, node: str) -> None:
        """Stop that node's agent: it publishes nothing more, like a dead agent."""
        sim = self.nodes.get(node)
        if sim is None:
            raise FaultError(f"no node {node!r} in the fleet")
        sim.killed = True
        if sim.service is not None:
            sim.service.request_stop()

    def apply(
        self,
        kind: str,
        node: str,
        *,
        count: int | None = None,
        duration_s: float | None = None,
        line: str = "",
        slowdown: float | None = None,
    ) -> Applied:
        """Make fault ``kind`` happen on ``node`` now; stateful ones keep going on ticks."""
        if kind in RUNNER_KINDS:
            self.kill_agent(node)
            result = Applied(kind, f"agent of {node} stopped")
        else:
            result = apply_fault(
                self.tree(node),
                kind,
                self._rng,
                count=count,
                duration_s=duration_s,
                now=self._clock(),
                line=line,
                slowdown=slowdown,
            )
            if result.process is not None:
                self.processes.setdefault(node, []).append(result.process)
        self.applied.append((node, result))
        log.info("fault %s on %s: %s", kind, node, result.detail)
        return result

    def tick(self) -> None:
        """Advance every stateful fault (storms, heat, flaps) by one step, dropping
        finished ones, and the RDMA traffic of the nodes whose turn it is (each node's
        every :data:`TRAFFIC_EVERY` ticks)."""
        now = self._clock()
        turn = self._ticks % TRAFFIC_EVERY
        self._ticks += 1
        for i, sim in enumerate(self.nodes.values()):
            if sim.traffic is not None and i % TRAFFIC_EVERY == turn:
                sim.traffic.advance(now)
        for node, procs in list(self.processes.items()):
            left = [p for p in procs if not p.step(now)]
            if left:
                self.processes[node] = left
            else:
                del self.processes[node]

    async def run_scenario(self, scenario: Scenario, tick_s: float | None = None) -> None:
        """Apply the scenario's faults when due and tick stateful ones, until cancelled
        (or, with no fault left to apply and no process running, return)."""
        missing = unknown_nodes(scenario, self.node_names)
        if missing:
            raise ScenarioError(f"scenario names nodes not in the fleet: {', '.join(missing)}")
        applied: set[int] = set()
        step = tick_s or self.interval_s
        while len(applied) < len(scenario.fault) or self.processes:
            for index, fault in due_faults(scenario, self.elapsed_s, applied):
                applied.add(index)
                self.apply(
                    fault.kind,
                    fault.node,
                    count=fault.count,
                    duration_s=fault.duration_s,
                    line=fault.line,
                )
            self.tick()
            await asyncio.sleep(step)
