"""The safety rail: automatic isolation never takes more than a share of a cluster out.

Pure, like the lifecycle: :func:`apply_rail` takes a cluster's :class:`RailState`, its
size, the transitions of one round and the time, and returns the new state, the
transitions with each refused isolation replaced by its ``if_denied`` outcome (the node
stays in service, flagged), and at most one ``rail.tripped`` alert per window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from msgspec.structs import replace

from metalguard.controller.core.lifecycle_model import Decision, LifecycleConfig, Transition
from metalguard.proto.base import Reason
from metalguard.proto.nodes import RailState

SHARE_DIGITS = 6
"""``fraction * size`` is rounded to this many digits before it is floored, so float
error (0.29 * 100 = 28.999…) never costs a node."""
ALERT_NODES_SHOWN = 10
"""Flagged nodes named in an alert's message (all are counted)."""


class RailResult(NamedTuple):
    """What :func:`apply_rail` decided for one round."""

    state: RailState
    transitions: list[Transition]
    """The input transitions, in order; none of them wants an isolation any more."""
    alerts: tuple[Decision, ...]
    """At most one ``rail.tripped`` per window."""


def rail_limit(cluster_size: int, cfg: LifecycleConfig) -> int:
    """Automatic isolations a cluster allows per window.

    ``max(rail_min_nodes, floor(rail_max_fraction * size))``, never more than the cluster:
    rounding down keeps the share a true maximum; ``rail_min_nodes`` lets a small cluster
    (5 nodes * 10 % = 0.5) still isolate one.
    """
    share = math.floor(round(cfg.rail_max_fraction * cluster_size, SHARE_DIGITS))
    return max(0, min(cluster_size, max(cfg.rail_min_nodes, share)))


def apply_rail(
    state: RailState,
    cluster_size: int,
    transitions: Sequence[Transition],
    now: float,
    cfg: LifecycleConfig,
) -> RailResult:
    """Allow the isolations ``transitions`` want while the cluster's window has room.

    The most urgent go first (fatal, then lowest score, then by name).  A refused one is
    replaced by its ``if_denied`` outcome; the first refusal in a window raises one
    ``rail.tripped`` alert.  ``cluster_size`` counts every node the controller knows there.
    """
    for t in transitions:
        node = t.record.node
        if (node.region, node.cluster) != (state.region, state.cluster):
            raise ValueError(
                f"{node.handle} is not in {state.region}.{state.cluster}: one rail per cluster"
            )
    recent = [ts for ts in state.isolations if ts > now - cfg.rail_window_s]
    limit = rail_limit(cluster_size, cfg)
    out = list(transitions)
    refused: list[Transition] = []
    wanted = [(i, t, t.if_denied) for i, t in enumerate(transitions) if t.if_denied]
    for i, t, if_denied in sorted(wanted, key=lambda w: _urgency(w[1])):
        if len(recent) < limit:
            recent.append(now)
            out[i] = Transition(t.record, t.decisions)
        else:
            out[i] = if_denied
            refused.append(t)
    tripped_ts = state.tripped_ts
    alerts: tuple[Decision, ...] = ()
    if refused and (tripped_ts is None or now - tripped_ts >= cfg.rail_window_s):
        alerts = (_alert(state, cluster_size, limit, len(recent), refused, now, cfg),)
        tripped_ts = now
    if tuple(recent) == state.isolations and tripped_ts == state.tripped_ts:
        return RailResult(state, out, alerts)
    new_state = replace(state, isolations=tuple(recent), tripped_ts=tripped_ts, updated_ts=now)
    return RailResult(new_state, out, alerts)


def _urgency(t: Transition) -> tuple[bool, float, str]:
    """Sort key: fatal first, then the lowest score, then the node's name."""
    fatal = any(d.attributes.get("fatal") is True for d in t.decisions)
    return (not fatal, t.record.score, t.record.node.node)


def _alert(
    state: RailState,
    cluster_size: int,
    limit: int,
    used: int,
    refused: list[Transition],
    now: float,
    cfg: LifecycleConfig,
) -> Decision:
    """The one ``rail.tripped`` alert of a window."""
    names = sorted(t.record.node.node for t in refused)
    shown = ", ".join(names[:ALERT_NODES_SHOWN])
    more = f" and {len(names) - ALERT_NODES_SHOWN} more" if len(names) > ALERT_NODES_SHOWN else ""
    window = f"{cfg.rail_window_s:g} s"
    share = f"{cfg.rail_max_fraction:.0%}"
    reason = Reason(
        signal="rail.isolations_in_window",
        value=used,
        threshold=limit,
        rule="rail_max_fraction",
        message=(
            f"{used} automatic isolations in the last {window}; the limit for "
            f"{cluster_size} nodes is {limit} ({share}, at least {cfg.rail_min_nodes})"
        ),
    )
    return Decision(
        kind="rail.tripped",
        ts=now,
        region=state.region,
        cluster=state.cluster,
        reasons=(reason,),
        message=(
            f"safety rail tripped in {state.region}.{state.cluster}: {len(names)} node(s) "
            f"kept in service and flagged instead of isolated ({shown}{more}); "
            "check for a fleet-wide sensor or rule fault before acting"
        ),
        by="rail",
        attributes={
            "cluster_size": cluster_size,
            "limit": limit,
            "isolated_in_window": used,
            "flagged": len(names),
            "window_s": cfg.rail_window_s,
        },
    )
