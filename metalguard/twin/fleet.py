"""The twin's fleet: ``N`` identical nodes in racks and clusters, or a real node list
(the Alibaba GPU trace's ``openb_node_list_gpu_node.csv``), as the scheduler's
:class:`~metalguard.controller.jobs.scheduler.FleetNode` records.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.csvrows import cell, number, read_table
from metalguard.twin.errors import TwinInputError

REGION = "twin"
RACK_NODES = 16
RACKS_PER_CLUSTER = 32
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
"""The node list's required columns."""

_TOKEN_BAD = re.compile(r"[.*>\s]")
"""Characters a handle's part may not hold (a NATS subject token)."""


def _chunks(items: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def fleet_from_count(
    n: int,
    *,
    gpus_per_node: int = 8,
    gpu_type: str = "H100",
    rack_nodes: int = RACK_NODES,
    racks_per_cluster: int = RACKS_PER_CLUSTER,
    region: str = REGION,
    cpu_cores: int = 192,
    memory_gb: int = 2048,
    bandwidth_tier: int = 0,
) -> tuple[FleetNode, ...]:
    """``n`` identical nodes: clusters of ``racks_per_cluster`` racks of ``rack_nodes``
    nodes (one leaf per rack), handles ``twin.c0001.n000001`` numbered across the fleet,
    so that sorted handles are in creation order (the widths grow past 9,999 clusters or
    999,999 nodes)."""
    if n < 1:
        raise ValueError(f"a fleet needs at least one node, not {n}")
    if rack_nodes < 1 or racks_per_cluster < 1:
        raise ValueError("rack_nodes and racks_per_cluster must be positive")
    per_cluster = rack_nodes * racks_per_cluster
    clusters = -(-n // per_cluster)
    nw = max(6, len(str(n)))
    cw = max(4, len(str(clusters)))
    rw = max(3, len(str(racks_per_cluster)))
    nodes: list[FleetNode] = []
    for i in range(n):
        c, within = divmod(i, per_cluster)
        cluster = f"c{c + 1:0{cw}d}"
        nodes.append(
            FleetNode(
                handle=f"{region}.{cluster}.n{i + 1:0{nw}d}",
                region=region,
                cluster=cluster,
                rack=f"r{within // rack_nodes + 1:0{rw}d}",
                gpus=gpus_per_node,
                gpu_type=gpu_type,
                cpu_cores=cpu_cores,
                memory_gb=memory_gb,
                bandwidth_tier=bandwidth_tier,
            )
        )
    return tuple(nodes)


def fleet_from_csv(
    path: str | Path,
    *,
    rack_nodes: int = RACK_NODES,
    racks_per_cluster: int = RACKS_PER_CLUSTER,
    region: str = REGION,
) -> tuple[FleetNode, ...]:
    """The nodes of a node list with the columns ``sn, cpu_milli, memory_mib, gpu,
    model`` (others are ignored): ``gpu_type`` = model, ``cpu_cores`` = cpu_milli // 1000,
    ``memory_gb`` = memory_mib // 1024 (rounded down: what a node surely has).

    Per model (in order of first appearance) the nodes, in file order, fill racks of
    ``rack_nodes`` and clusters of ``racks_per_cluster`` racks; the cluster is named for
    the model (``g2-c01``), the node by its ``sn``: ``twin.g2-c01.openb-node-0042``.

    Errors (:class:`TwinInputError` with the file and the row; rows count the header as
    row 1, so the first node is row 2): missing columns (all named), a value that is not
    a whole non-negative number, an empty, duplicated or non-token ``sn`` (no ``.``,
    ``*``, ``>``, spaces), an empty model, no nodes at all.
    """
    if rack_nodes < 1 or racks_per_cluster < 1:
        raise ValueError("rack_nodes and racks_per_cluster must be positive")
    table = read_table(path, NODE_COLUMNS)
    by_model: dict[str, list[int]] = {}
    parsed: list[tuple[str, int, int, int, str]] = []
    seen: dict[str, int] = {}
    for row, cells in table.rows:
        sn = cell(table, cells, "sn")
        if not sn or _TOKEN_BAD.search(sn):
            raise TwinInputError(
                table.path, f"row {row}", f"sn {sn!r} is not a node name (no '.', '*', '>', spaces)"
            )
        if sn in seen:
            raise TwinInputError(table.path, f"row {row}", f"sn {sn} repeats row {seen[sn]}")
        seen[sn] = row
        values = [
            int(number(table, row, col, cell(table, cells, col), integer=True))
            for col in ("cpu_milli", "memory_mib", "gpu")
        ]
        model = cell(table, cells, "model")
        if not model:
            raise TwinInputError(table.path, f"row {row}", "column model is empty")
        by_model.setdefault(model, []).append(len(parsed))
        parsed.append((sn, values[0], values[1], values[2], model))
    if not parsed:
        raise TwinInputError(table.path, "", "no nodes: the file has a header but no rows")
    per_cluster = rack_nodes * racks_per_cluster
    nodes: list[FleetNode] = []
    for model, indices in by_model.items():
        stem = _TOKEN_BAD.sub("-", model).lower()
        for c, members in enumerate(_chunks(indices, per_cluster)):
            cluster = f"{stem}-c{c + 1:02d}"
            for r, rack in enumerate(_chunks(members, rack_nodes)):
                for i in rack:
                    sn, cpu_milli, memory_mib, gpus, _ = parsed[i]
                    nodes.append(
                        FleetNode(
                            handle=f"{region}.{cluster}.{sn}",
                            region=region,
                            cluster=cluster,
                            rack=f"r{r + 1:03d}",
                            gpus=gpus,
                            gpu_type=model,
                            cpu_cores=cpu_milli // 1000,
                            memory_gb=memory_mib // 1024,
                        )
                    )
    return tuple(nodes)


def load_fleet(spec: str | int) -> tuple[FleetNode, ...]:
    """``--nodes``: a node count (``2048``: :func:`fleet_from_count`'s defaults) or the
    path of a node list (:func:`fleet_from_csv`)."""
    text = str(spec).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        count = int(text)
        if count < 1:
            raise TwinInputError("--nodes", "", f"{count} nodes: the fleet needs at least one node")
        return fleet_from_count(count)
    return fleet_from_csv(text)


def fleet_gpus(nodes: Sequence[FleetNode]) -> int:
    """GPUs in the fleet."""
    return sum(n.gpus for n in nodes)


def fleet_dict(nodes: Sequence[FleetNode], spec: str | int = "") -> dict[str, object]:
    """The fleet's stated shape, for the report: nodes, GPUs, clusters, racks, and the
    node count per (GPU type, GPUs per node)."""
    shapes: dict[str, int] = {}
    for n in nodes:
        key = f"{n.gpu_type or 'none'} x{n.gpus}"
        shapes[key] = shapes.get(key, 0) + 1
    return {
        "spec": str(spec),
        "nodes": len(nodes),
        "gpus": fleet_gpus(nodes),
        "clusters": len({(n.region, n.cluster) for n in nodes}),
        "racks": len({n.rack_key for n in nodes}),
        "shapes": dict(sorted(shapes.items())),
    }
