"""Traffic on a simulated node's RDMA ports: the data and packet counters a busy link
moves (docs/simulation.md "RDMA").

:class:`Traffic` keeps each port's data counters in memory (read from the tree once) and
:meth:`Traffic.advance` adds what the time since the last call carried, to the ports
that are ACTIVE; error counters are left to the faults.  The fleet runner advances a
node's traffic every few ticks only (writes are atomic renames, and a fleet of 64 nodes
shares one core), so the counters move in steps.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from metalguard.demo.sim.tree import RDMA_DATA_COUNTERS, STATE_ACTIVE, NodeTree

WORDS_PER_PACKET = 1024
"""4-octet words per packet: a 4 KiB MTU."""
MIN_WORDS_PER_S = 40_000
MAX_WORDS_PER_S = 80_000
"""Data words each way per second, per port: modest (a few hundred KB/s) so that a
32-bit ``port_xmit_data`` (4 294 967 295) is not reached in 10 hours of simulation."""


@dataclass(slots=True)
class Moving:
    """One moving counter: its file (and the temp name it is renamed from), its value and
    its rate."""

    path: str
    tmp: str
    value: int
    per_s: float


@dataclass(slots=True)
class PortTraffic:
    """One port's ``state`` file and moving counters."""

    state_path: str
    counters: list[Moving]


def _replace(moving: Moving) -> None:
    """Write the counter's value atomically (like faults.write_atomic, at less cost: the
    fleet's ticks write a few hundred of these a second)."""
    fd = os.open(moving.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"%d\n" % moving.value)
    finally:
        os.close(fd)
    os.replace(moving.tmp, moving.path)


@dataclass(slots=True)
class Traffic:
    """The moving counters of every RDMA port of one tree."""

    tree: NodeTree
    ports: list[PortTraffic] = field(default_factory=list)
    last: float | None = None
    writes: int = 0
    """Counter files written so far (the cost this adds to the fleet's ticks)."""

    @classmethod
    def of(cls, tree: NodeTree, rng: random.Random) -> Traffic:
        """Traffic over ``tree``'s ports at rates drawn with ``rng``, from the values the
        tree holds now."""
        ports = []
        for port in tree.paths.rdma_ports:
            tx = rng.uniform(MIN_WORDS_PER_S, MAX_WORDS_PER_S)
            rx = rng.uniform(MIN_WORDS_PER_S, MAX_WORDS_PER_S)
            per_s = {
                "port_xmit_data": tx,
                "port_rcv_data": rx,
                "port_xmit_packets": tx / WORDS_PER_PACKET,
                "port_rcv_packets": rx / WORDS_PER_PACKET,
                "unicast_xmit_packets": tx / WORDS_PER_PACKET,
                "unicast_rcv_packets": rx / WORDS_PER_PACKET,
            }
            moving = []
            for counter in RDMA_DATA_COUNTERS:
                path = tree.sys_path(f"{port}/counters/{counter}")
                value = int(path.read_text())
                tmp = str(path.with_name(f".{path.name}.tmp"))
                moving.append(Moving(str(path), tmp, value, per_s[counter]))
            ports.append(PortTraffic(str(tree.sys_path(f"{port}/state")), moving))
        return cls(tree, ports)

    def advance(self, now: float) -> None:
        """Add what flowed since the last call (nothing on the first) to every ACTIVE
        port's data and packet counters."""
        last, self.last = self.last, now
        if last is None or now <= last:
            return
        elapsed = now - last
        for port in self.ports:
            with open(port.state_path) as f:
                if f.read().strip() != STATE_ACTIVE:
                    continue  # a port that is down carries nothing
            for moving in port.counters:
                moving.value += max(1, round(moving.per_s * elapsed))
                _replace(moving)
                self.writes += 1
