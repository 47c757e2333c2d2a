"""QosProfile: the declared RDMA flow-control settings of a cluster or node.

The same Struct is the TOML file form (docs/qos.md), so unknown keys are rejected here,
unlike the telemetry messages, which ignore fields they do not know.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proto.base import Message, NonNegInt, Percent, Priority, Record

Dscp = Annotated[int, msgspec.Meta(ge=0, le=63)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]


class InterfaceMatch(Record, frozen=True, forbid_unknown_fields=True):
    """Which interfaces a profile applies to: names, or a match by driver / PCI class."""

    names: tuple[str, ...] = ()
    driver: str | None = None
    pci_class: str | None = None


class EcnMarking(Record, frozen=True, forbid_unknown_fields=True):
    """ECN/RED marking thresholds of one traffic class."""

    min_kb: Annotated[int, msgspec.Meta(ge=1)]
    max_kb: Annotated[int, msgspec.Meta(ge=1)]
    probability: Probability = 1.0


class TrafficClass(Record, frozen=True, forbid_unknown_fields=True):
    """One priority queue: which priorities it serves and its bandwidth share."""

    name: str
    priorities: tuple[Priority, ...]
    bandwidth_percent: Percent
    strict: bool = False
    ecn: EcnMarking | None = None


class Dcqcn(Record, frozen=True, forbid_unknown_fields=True):
    """DCQCN congestion-control parameters (notification and reaction points)."""

    np: dict[str, NonNegInt] = {}
    rp: dict[str, NonNegInt] = {}


class QosProfile(Message, frozen=True, forbid_unknown_fields=True, tag="qos_profile"):
    """A cluster's (or one node's override) declared flow-control profile."""

    version: NonNegInt
    interfaces: InterfaceMatch = InterfaceMatch()
    trust: Literal["dscp", "pcp"] = "dscp"
    pfc_priorities: tuple[Priority, ...] = ()
    dscp_map: dict[Dscp, Priority] = {}
    link_rate_mbit: Annotated[int, msgspec.Meta(ge=1)] | None = None
    traffic_class: tuple[TrafficClass, ...] = ()
    dcqcn: Dcqcn | None = None
