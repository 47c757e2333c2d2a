"""RDMA rules: InfiniBand and RoCE ports (``TelemetryBatch.rdma``) that went down, cabled
ports without a physical link, link flaps, physical errors, RoCE retransmissions, ports
below their expected rate, and PMA counters stuck at their maximum. The reasons' signals
start with ``rdma.``, the node's RDMA fabric component; the messages name the port as
``<device>/<port>`` (``RDMA port mlx5_0/1 (ens1f0np0)``).

The node's topology is ``batch.topology``: the region controller hands the scorer the
node's resolved topology there (its ``[node]`` report overridden by the controller's
``[topology]``, :mod:`metalguard.controller.core.topology`), so ``rdma_ports`` and
``rdma_rate_gbps`` may come from either.

PMA counters (``counters/``) do not wrap: one that reaches its width's maximum stays there
(the agent lists it in ``RdmaPort.saturated``). Its growth up to the maximum is real and
counts; while it is stuck it grows no more, so it is never a rate, and
``rdma_counter_saturated`` notes that it is blind. Clearing it (``perfquery -R``, a driver
reload) is a drop: a reset, like any other (docs/scoring.md "Rates, growth and resets").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    flagged,
    growth_only,
    growth_rate_finding,
    reads,
)
from metalguard.controller.core.scoring.config import FlagRule, LostStateRule, RateRule
from metalguard.proto.telemetry import RdmaPort, TelemetryBatch

COLLECTOR = "rdma"
"""The agent's collector of ``TelemetryBatch.rdma``."""
UP_STATES = frozenset({"ACTIVE", "ACTIVE_DEFER"})
"""Logical states of a port that carries traffic."""
LINK_UP = "LinkUp"
"""The physical state of a port with a link."""
FLAP_COUNTERS = ("link_downed", "link_error_recovery")
PHYS_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
RETRANSMIT_COUNTERS = ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err")
"""RoCE retransmission counters (``hw_counters``: the port's, else the device's)."""
PMA_READ = (*FLAP_COUNTERS, *PHYS_COUNTERS)
"""The PMA counters (``counters/``) the rules read."""
ACTIVE_SUFFIX = ".active"

Member = tuple[str, str]
"""(kernel counter name, history key)"""


@reads("rdma")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Per port: the PMA flap and error counters the rules read, the RoCE retransmission
    counters (per port, or once per device where only the device has them), and
    ``rdma.<device>.<port>.active`` = 1 while the port is ACTIVE (its history's newest
    sample is when the port was last seen ACTIVE: :meth:`NodeSignals.last_seen`)."""
    for port in batch.rdma:
        for name in PMA_READ:
            value = port.counters.get(name)
            if value is not None:
                yield _key(port, name), value
        if port.state in UP_STATES:
            yield _active_key(port.device, port.port), 1
    for _port, _subject, members, values in _retransmit_groups(batch.rdma):
        for name, key in members:
            yield key, values[name]


@configured
def rdma_port_down(ctx: Context, rule: LostStateRule) -> Iterator[Finding]:
    """A port seen ACTIVE within ``window_s`` that is not ACTIVE now, or no longer reported
    (while the batch speaks for the node's ports), for ``grace_s`` or more. A port that
    ``rdma_cabled_port_down`` reports is left to it."""
    batch = ctx.batch
    reported = _reports_ports(batch)
    if not batch.rdma and not reported:
        return
    cabled = ctx.rules.rdma_cabled_port_down.enabled
    skip = {name for name, _ in _cabled_down(batch)} if cabled else set()
    for port in batch.rdma:
        if not port.state or port.state in UP_STATES or _name(port) in skip:
            continue
        gone = _gone_s(ctx, _active_key(port.device, port.port), rule)
        if gone is not None:
            phys = f" (physical state {port.phys_state})" if port.phys_state else ""
            yield _port_down(rule, port.state, f"{_subject(port)} is {port.state}{phys}", gone)
    if not reported:
        return
    skip |= {_name(port) for port in batch.rdma}
    for key in ctx.signals.counters:
        if not (key.startswith("rdma.") and key.endswith(ACTIVE_SUFFIX)):
            continue
        device, _, number = key[len("rdma.") : -len(ACTIVE_SUFFIX)].rpartition(".")
        name = f"{device}/{number}"
        gone = None if name in skip else _gone_s(ctx, key, rule)
        if gone is not None:
            what = f"RDMA port {name} is no longer reported (device removed or driver unloaded?)"
            yield _port_down(rule, "absent", what, gone)


def _port_down(rule: LostStateRule, value: str, what: str, gone: float) -> Finding:
    return flagged(
        "rdma_port_down",
        rule,
        signal="rdma.port_state",
        value=value,
        threshold="ACTIVE",
        message=f"{what}; last seen ACTIVE {gone:g} s ago",
    )


def _gone_s(ctx: Context, key: str, rule: LostStateRule) -> float | None:
    """How long the state whose presence key is ``key`` has been gone, if it was seen
    within the window and has been gone for ``grace_s`` or more (and more than 0 s)."""
    seen, now = ctx.signals.last_seen(key), ctx.now
    if seen is None or seen < now - rule.window_s:
        return None
    gone = now - seen
    return gone if gone > 0 and gone >= rule.grace_s else None


@reads("rdma", "topology", "collectors")
@configured
def rdma_cabled_port_down(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A port the node's topology lists as cabled (``rdma_ports``) whose physical state is
    not LinkUp, or which the node does not report."""
    for name, port in _cabled_down(ctx.batch):
        if port is None:
            value, what = (
                "absent",
                "the node does not report it (device gone or driver not loaded?)",
            )
        else:
            value, what = port.phys_state, f"its physical state is {port.phys_state}, not LinkUp"
        subject = f"RDMA port {name}" if port is None else _subject(port)
        yield flagged(
            "rdma_cabled_port_down",
            rule,
            signal="rdma.cabled_port",
            value=value,
            threshold=LINK_UP,
            message=f"{subject} is cabled (topology rdma_ports) but {what}",
        )


@growth_only
@configured
def rdma_link_flap_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """``link_downed`` + ``link_error_recovery`` per port per hour over the window."""
    groups = ((port, _subject(port), _pma_members(port, FLAP_COUNTERS)) for port in ctx.batch.rdma)
    yield from _rates(ctx, "rdma_link_flap_rate", rule, groups, "rdma.link_flap_rate", "link flap")


@growth_only
@configured
def rdma_phys_error_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """Symbol, receive, link-integrity and buffer-overrun errors per port per hour."""
    groups = ((port, _subject(port), _pma_members(port, PHYS_COUNTERS)) for port in ctx.batch.rdma)
    yield from _rates(
        ctx, "rdma_phys_error_rate", rule, groups, "rdma.phys_error_rate", "physical error"
    )


@growth_only
@configured
def rdma_retransmit_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """RoCE retransmissions (``out_of_sequence``, ``packet_seq_err``,
    ``local_ack_timeout_err``) per port (or device) per hour over the window."""
    groups = (
        (port, subject, members) for port, subject, members, _ in _retransmit_groups(ctx.batch.rdma)
    )
    yield from _rates(
        ctx, "rdma_retransmit_rate", rule, groups, "rdma.retransmit_rate", "RoCE retransmission"
    )


@reads("rdma", "topology")
@configured
def rdma_rate_below_expected(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """An ACTIVE port below the topology's ``rdma_rate_gbps`` (when > 0): the ports of
    ``rdma_ports``, or every port when it lists none."""
    topology = ctx.batch.topology
    if topology is None or topology.rdma_rate_gbps <= 0:
        return
    expected = topology.rdma_rate_gbps
    listed = set(topology.rdma_ports)
    for port in ctx.batch.rdma:
        if listed and _name(port) not in listed:
            continue
        rate = port.rate_gbps
        if port.state not in UP_STATES or rate is None or rate >= expected:
            continue
        yield flagged(
            "rdma_rate_below_expected",
            rule,
            signal="rdma.rate",
            value=rate,
            threshold=expected,
            message=f"{_subject(port)} runs at {rate:g} Gb/s, below the expected "
            f"{expected:g} Gb/s (topology rdma_rate_gbps)",
        )


@reads("rdma")
@configured
def rdma_counter_saturated(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A port whose flap or error counters stopped at their maximum: one note per port,
    naming them (they count again once cleared)."""
    for port in ctx.batch.rdma:
        stuck = [name for name in PMA_READ if name in port.saturated]
        if not stuck:
            continue
        shown = ", ".join(
            f"{name} ({port.counters[name]})" if name in port.counters else name for name in stuck
        )
        yield flagged(
            "rdma_counter_saturated",
            rule,
            signal="rdma.counter_saturated",
            value=", ".join(stuck),
            message=f"{_subject(port)}: counters stuck at their maximum, blind to new "
            f"errors until cleared (perfquery -R): {shown}",
        )


RULES = (
    rdma_port_down,
    rdma_cabled_port_down,
    rdma_link_flap_rate,
    rdma_phys_error_rate,
    rdma_retransmit_rate,
    rdma_rate_below_expected,
    rdma_counter_saturated,
)


def _rates(
    ctx: Context,
    key: str,
    rule: RateRule,
    groups: Iterable[tuple[RdmaPort, str, list[Member]]],
    signal: str,
    noun: str,
) -> Iterator[Finding]:
    """One finding per group whose counters' summed growth reaches a level; the message
    names the counters that grew (``noun``: singular, an ``s`` is added for more than one)."""
    window, now, increase = rule.window_s, ctx.now, ctx.signals.increase
    for port, subject, members in groups:
        grown = [(name, increase(key_, window, now)) for name, key_ in members]
        total = sum(n for _, n in grown)
        if total == 0:
            continue
        detail = ", ".join(
            f"{name} +{n}" + (" (saturated)" if name in port.saturated else "")
            for name, n in grown
            if n
        )
        found = growth_rate_finding(
            key,
            rule,
            total,
            signal=signal,
            what=f"{noun}{'' if total == 1 else 's'} ({detail})",
            subject=subject,
        )
        if found is not None:
            yield found


def _reports_ports(batch: TelemetryBatch) -> bool:
    """Whether the batch speaks for all the node's RDMA ports: it carries some (the
    collector's last run succeeded), or this cycle's run succeeded and found none. A
    failed run (``collector_failed``) or no collector at all says nothing."""
    runs = [run.success for run in batch.collectors if run.collector == COLLECTOR]
    if runs and not all(runs):
        return False
    return bool(batch.rdma) or bool(runs)


def _cabled_down(batch: TelemetryBatch) -> Iterator[tuple[str, RdmaPort | None]]:
    """The topology's cabled ports without a link: (name, port), port None when absent.
    A port whose physical state is unknown ("") is not judged."""
    topology = batch.topology
    if topology is None or not topology.rdma_ports:
        return
    ports = {_name(port): port for port in batch.rdma}
    reported = _reports_ports(batch)
    for name in dict.fromkeys(topology.rdma_ports):
        port = ports.get(name)
        if port is None:
            if reported:
                yield name, None
        elif port.phys_state and port.phys_state != LINK_UP:
            yield name, port


def _retransmit_groups(
    ports: Iterable[RdmaPort],
) -> Iterator[tuple[RdmaPort, str, list[Member], dict[str, int]]]:
    """(port, subject, members, their counters) of the RoCE retransmission counters: a
    port's own ``hw_counters`` when it has any of them, else its device's (judged once
    per device, under a device key)."""
    devices: set[str] = set()
    for port in ports:
        own = [name for name in RETRANSMIT_COUNTERS if name in port.hw_counters]
        if own:
            yield port, _subject(port), [(n, _key(port, n)) for n in own], port.hw_counters
            continue
        shared = [name for name in RETRANSMIT_COUNTERS if name in port.device_hw_counters]
        if shared and port.device not in devices:
            devices.add(port.device)
            members = [(n, f"rdma.{port.device}.{n}") for n in shared]
            yield port, f"RDMA device {port.device}", members, port.device_hw_counters


def _pma_members(port: RdmaPort, names: tuple[str, ...]) -> list[Member]:
    return [(name, _key(port, name)) for name in names if name in port.counters]


def _name(port: RdmaPort) -> str:
    return f"{port.device}/{port.port}"


def _key(port: RdmaPort, counter: str) -> str:
    return f"rdma.{port.device}.{port.port}.{counter}"


def _active_key(device: str, port: int) -> str:
    return f"rdma.{device}.{port}{ACTIVE_SUFFIX}"


def _subject(port: RdmaPort) -> str:
    netdev = f" ({port.netdev})" if port.netdev else ""
    return f"RDMA port {_name(port)}{netdev}"
