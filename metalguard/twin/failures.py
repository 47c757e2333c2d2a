"""The failure model: per-node-day fault rates by cause (with the signal each shows and
how often metalguard sees a precursor first), planned maintenance, and the draws of one
run's faults from it.

File format (TOML; ``data/llama3.toml`` is the default and an example)::

    total_rate_per_node_day = 0.0038   # optional: the causes' shares are scaled to it
    [planned]
    rate_per_node_day = 0.000425
    duration = {kind = "lognormal", mean_s = 3600, sigma = 0.5}
    [causes.gpu_hbm3]
    share = 72                         # or rate_per_node_day = ... (without the total)
    kind = "hardware"                  # hardware | software | hang
    signal = "ecc"                     # "" | gpu | ecc | pcie | smart | thermal | network
    precursor_fraction = 0.7           # in [0, 1]; above 0 needs a signal
    lead_time = {kind = "lognormal", mean_s = 21600, sigma = 1.0}
    repair = {kind = "lognormal", mean_s = 86400, sigma = 0.5}

A distribution is ``{kind = "fixed" | "exponential" | "lognormal", mean_s = S, sigma =
X}``: ``mean_s`` is the mean (fixed, exponential) or the median (lognormal); ``sigma``
(lognormal only, default 1) its shape.

Stragglers (fail-slow nodes: slower, not failed) are optional; a ``[stragglers]`` table
turns them on, every key defaulting to :mod:`.model`'s ``DEFAULT_STRAGGLER_*`` and
``DEFAULT_SLOWDOWN`` (docs/twin.md "Stragglers")::

    [stragglers]
    rate_per_node_day = 0.002          # episodes per node-day
    duration = {kind = "lognormal", mean_s = 3600, sigma = 1.0}   # if nothing acts
    repair = {kind = "lognormal", mean_s = 7200, sigma = 0.5}     # once drained for it
    [stragglers.slowdown]              # 0.2: 20 % slower
    kind = "discrete"                  # or "fixed" (value = 0.2), or "lognormal"
    values = [0.05, 0.1, 0.2, 0.3, 0.4, 0.6]   # (median, sigma, min, max)
    weights = [10, 15, 20, 20, 20, 15]
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import get_args

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.errors import TwinInputError, read_toml
from metalguard.twin.model import (
    DAY_S,
    DEFAULT_STRAGGLER_RATE_PER_NODE_DAY,
    Distribution,
    FailureCause,
    FailureModel,
    Fault,
    FaultKind,
    PlannedMaintenance,
    Signal,
    Slowdown,
    Straggler,
    StragglerModel,
)

DEFAULT_FAILURES_PATH = Path(__file__).parent / "data" / "llama3.toml"
DEFAULT_SOURCE = "llama3 (default)"
LLAMA3_INTERRUPTIONS = 419
"""Unexpected interruptions of Llama 3 405B's pre-training (Table 5) ..."""
LLAMA3_PLANNED = 47
"""... planned ones (automated maintenance) ..."""
LLAMA3_NODE_DAYS = 2048 * 54
"""... over 54 days on 16,384 GPUs = 2,048 nodes."""

KINDS: tuple[str, ...] = get_args(FaultKind)
SIGNALS: tuple[str, ...] = get_args(Signal)
DISTRIBUTIONS = ("fixed", "exponential", "lognormal")

_TOP_KEYS = ("total_rate_per_node_day", "planned", "causes", "stragglers")
_STRAGGLER_KEYS = ("rate_per_node_day", "slowdown", "duration", "repair")
_SLOWDOWN_KEYS = ("kind", "value", "values", "weights", "median", "sigma", "min", "max")
SLOWDOWN_KINDS = ("discrete", "fixed", "lognormal")
_PLANNED_KEYS = ("rate_per_node_day", "duration")
_CAUSE_KEYS = (
    "share",
    "rate_per_node_day",
    "kind",
    "signal",
    "precursor_fraction",
    "lead_time",
    "repair",
)
_DIST_KEYS = ("kind", "mean_s", "sigma")

NodeLike = FleetNode | str
_NONE = {"kind": "fixed", "mean_s": 0.0}
"""A lead time or repair not given: none (0 s)."""


# --- reading and checking -------------------------------------------------------------


class _File:
    """One file's checks: every error names the file and the key path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, key: str, problem: str) -> TwinInputError:
        return TwinInputError(self.path, f"key {key}" if key else "", problem)

    def table(self, value: object, key: str, known: Sequence[str]) -> Mapping[str, object]:
        if not isinstance(value, dict):
            raise self.error(key, f"{value!r} is not a table")
        for k in value:
            if k not in known:
                full = f"{key}.{k}" if key else k
                raise self.error(full, f"unknown key (known: {', '.join(known)})")
        return value

    def number(self, value: object, key: str, *, at_most: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"{value!r} is not a number")
        if not math.isfinite(value):
            raise self.error(key, f"{value} is not finite")
        if value < 0:
            raise self.error(key, f"{value} is negative")
        if at_most is not None and value > at_most:
            raise self.error(key, f"{value} is above {at_most:g}")
        return float(value)

    def choice(self, value: object, key: str, allowed: Sequence[str]) -> str:
        if not isinstance(value, str) or value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise self.error(key, f"{value!r} is not one of {shown}")
        return value

    def distribution(self, value: object, key: str) -> Distribution:
        table = self.table(value, key, _DIST_KEYS)
        if "kind" not in table:
            raise self.error(f"{key}.kind", f"missing (one of {', '.join(DISTRIBUTIONS)})")
        kind = self.choice(table["kind"], f"{key}.kind", DISTRIBUTIONS)
        if "mean_s" not in table:
            raise self.error(f"{key}.mean_s", "missing")
        mean = self.number(table["mean_s"], f"{key}.mean_s")
        if "sigma" in table and kind != "lognormal":
            raise self.error(f"{key}.sigma", f"only a lognormal has a sigma, not {kind}")
        sigma = self.number(table.get("sigma", 1.0), f"{key}.sigma")
        return Distribution(kind, mean, sigma)  # type: ignore[arg-type]

    def numbers(self, value: object, key: str) -> tuple[float, ...]:
        if not isinstance(value, list) or not value:
            raise self.error(key, f"{value!r} is not a non-empty list of numbers")
        return tuple(self.number(v, f"{key}[{i}]") for i, v in enumerate(value))

    def slowdown(self, value: object, key: str) -> Slowdown:
        """A slowdown distribution (the module docstring has the forms)."""
        table = self.table(value, key, _SLOWDOWN_KEYS)
        kind = self.choice(table.get("kind", "discrete"), f"{key}.kind", SLOWDOWN_KINDS)
        allowed = {
            "fixed": ("kind", "value"),
            "discrete": ("kind", "values", "weights"),
            "lognormal": ("kind", "median", "sigma", "min", "max"),
        }[kind]
        for k in table:
            if k not in allowed:
                raise self.error(f"{key}.{k}", f"not a key of a {kind} slowdown")
        if kind == "fixed":
            if "value" not in table:
                raise self.error(f"{key}.value", "missing")
            return Slowdown("fixed", (self.number(table["value"], f"{key}.value"),), (1.0,))
        if kind == "discrete":
            if "values" not in table:
                raise self.error(f"{key}.values", "missing")
            values = self.numbers(table["values"], f"{key}.values")
            weights = (
                self.numbers(table["weights"], f"{key}.weights")
                if "weights" in table
                else (1.0,) * len(values)
            )
            if len(weights) != len(values):
                raise self.error(
                    f"{key}.weights", f"{len(weights)} weights for {len(values)} values"
                )
            if math.fsum(weights) <= 0:
                raise self.error(f"{key}.weights", "they sum to 0")
            return Slowdown("discrete", values, weights)
        if "median" not in table:
            raise self.error(f"{key}.median", "missing")
        median = self.number(table["median"], f"{key}.median")
        sigma = self.number(table.get("sigma", 0.5), f"{key}.sigma")
        low = self.number(table.get("min", 0.0), f"{key}.min")
        high = self.number(table.get("max", 1.0), f"{key}.max")
        if low > high:
            raise self.error(f"{key}.min", f"{low:g} is above max {high:g}")
        return Slowdown("lognormal", median=median, sigma=sigma, low=low, high=high)

    def stragglers(self, value: object, key: str) -> StragglerModel:
        """The ``[stragglers]`` table: every key defaults to the model's defaults."""
        table = self.table(value, key, _STRAGGLER_KEYS)
        default = StragglerModel()
        rate = self.number(
            table.get("rate_per_node_day", DEFAULT_STRAGGLER_RATE_PER_NODE_DAY),
            f"{key}.rate_per_node_day",
        )
        return StragglerModel(
            rate_per_node_day=rate,
            slowdown=(
                self.slowdown(table["slowdown"], f"{key}.slowdown")
                if "slowdown" in table
                else default.slowdown
            ),
            duration=(
                self.distribution(table["duration"], f"{key}.duration")
                if "duration" in table
                else default.duration
            ),
            repair=(
                self.distribution(table["repair"], f"{key}.repair")
                if "repair" in table
                else default.repair
            ),
        )


def load_failure_model(
    path: str | Path, *, total_rate_per_node_day: float | None = None, source: str = ""
) -> FailureModel:
    """A failure model from its TOML file (the module docstring has the format).

    ``total_rate_per_node_day`` (given here) replaces the file's total, or scales the
    causes' own rates to it. Errors (:class:`TwinInputError` with the file and the key
    path, e.g. ``key causes.gpu.precursor_fraction``): unreadable TOML, unknown keys,
    negative rates or shares, fractions above 1, unknown kinds, signals or
    distributions, a cause with both (or neither of) ``share`` and
    ``rate_per_node_day``, a precursor without a signal, shares summing to 0 under a
    positive total."""
    name = str(path)
    f = _File(name)
    data = read_toml(path)
    top = f.table(data, "", _TOP_KEYS)
    stragglers = (
        f.stragglers(top["stragglers"], "stragglers") if "stragglers" in top else StragglerModel()
    )
    total: float | None = None
    if "total_rate_per_node_day" in top:
        total = f.number(top["total_rate_per_node_day"], "total_rate_per_node_day")
    planned = f.table(top.get("planned", {}), "planned", _PLANNED_KEYS)
    planned_rate = f.number(planned.get("rate_per_node_day", 0.0), "planned.rate_per_node_day")
    planned_duration = (
        f.distribution(planned["duration"], "planned.duration")
        if "duration" in planned
        else FailureModel((), 0.0).planned_duration
    )
    causes_table = top.get("causes", {})
    if not isinstance(causes_table, dict):
        raise f.error("causes", "must be a table of [causes.<name>] tables")
    weights: list[float] = []
    causes: list[FailureCause] = []
    for cname, value in causes_table.items():
        key = f"causes.{cname}"
        cause = f.table(value, key, _CAUSE_KEYS)
        if total is not None:
            if "rate_per_node_day" in cause:
                raise f.error(
                    f"{key}.rate_per_node_day",
                    "give a share, not a rate, when total_rate_per_node_day is set",
                )
            if "share" not in cause:
                raise f.error(f"{key}.share", "missing (total_rate_per_node_day is set)")
            weights.append(f.number(cause["share"], f"{key}.share"))
        else:
            if "share" in cause:
                raise f.error(f"{key}.share", "a share needs a top-level total_rate_per_node_day")
            if "rate_per_node_day" not in cause:
                raise f.error(f"{key}.rate_per_node_day", "missing")
            weights.append(f.number(cause["rate_per_node_day"], f"{key}.rate_per_node_day"))
        kind = f.choice(cause.get("kind", "hardware"), f"{key}.kind", KINDS)
        signal = f.choice(cause.get("signal", ""), f"{key}.signal", SIGNALS)
        fraction = f.number(
            cause.get("precursor_fraction", 0.0), f"{key}.precursor_fraction", at_most=1.0
        )
        if fraction > 0 and not signal:
            raise f.error(
                f"{key}.precursor_fraction",
                f"{fraction} needs a signal to show the precursor on (signal is empty)",
            )
        lead = f.distribution(cause.get("lead_time", _NONE), f"{key}.lead_time")
        repair = f.distribution(cause.get("repair", _NONE), f"{key}.repair")
        causes.append(
            FailureCause(
                name=cname,
                rate_per_node_day=0.0,
                kind=kind,  # type: ignore[arg-type]
                signal=signal,  # type: ignore[arg-type]
                precursor_fraction=fraction,
                lead_time=lead,
                repair=repair,
            )
        )
    target = total_rate_per_node_day if total_rate_per_node_day is not None else total
    weight_sum = math.fsum(weights)
    if target is None:
        rates = weights
    elif target < 0 or not math.isfinite(target):
        raise TwinInputError(name, "", f"total rate {target} is negative (or not finite)")
    elif weight_sum == 0:
        if target > 0:
            raise f.error(
                "causes",
                f"no cause has a positive share or rate to make up the total {target:g}",
            )
        rates = [0.0] * len(weights)
    else:
        rates = [w / weight_sum * target for w in weights]
    return FailureModel(
        causes=tuple(
            dataclasses.replace(c, rate_per_node_day=r) for c, r in zip(causes, rates, strict=True)
        ),
        planned_rate_per_node_day=planned_rate,
        planned_duration=planned_duration,
        source=source or name,
        stragglers=stragglers,
    )


def default_failure_model(total_rate_per_node_day: float | None = None) -> FailureModel:
    """Llama 3 405B's interruption mix (``data/llama3.toml``): 419 unexpected
    interruptions and 47 planned ones over 2,048 nodes x 54 days, by cause; a total rate
    given here keeps the mix and scales it."""
    return load_failure_model(
        DEFAULT_FAILURES_PATH,
        total_rate_per_node_day=total_rate_per_node_day,
        source=DEFAULT_SOURCE,
    )


# --- drawing a run's faults -----------------------------------------------------------


def sample(dist: Distribution, rng: random.Random) -> float:
    """One draw of ``dist`` (seconds, >= 0)."""
    if dist.kind == "fixed" or dist.mean_s <= 0:
        return dist.mean_s
    if dist.kind == "exponential":
        return rng.expovariate(1.0 / dist.mean_s)
    return dist.mean_s * math.exp(dist.sigma * rng.normalvariate(0.0, 1.0))


def _handles(nodes: Sequence[NodeLike]) -> list[str]:
    return [n if isinstance(n, str) else n.handle for n in nodes]


def draw_faults(
    model: FailureModel, nodes: Sequence[NodeLike], days: float, rng: random.Random
) -> tuple[Fault, ...]:
    """One run's unplanned faults: every cause a homogeneous Poisson process of rate
    ``rate_per_node_day`` on every node, drawn exactly as their merged process
    (exponential gaps at the total rate x nodes, then the cause by its share of the
    rate and the node uniformly). A fault shows a precursor with probability
    ``precursor_fraction``, ``lead_time`` before it (None when that falls before 0);
    its repair is drawn from the cause's ``repair``. Sorted by (at_s, fault_id), ids
    1, 2, ...; the same ``rng`` state (and node order) gives the same faults."""
    handles = _handles(nodes)
    rates = [c.rate_per_node_day for c in model.causes]
    total = math.fsum(rates)
    horizon = days * DAY_S
    if not handles or total <= 0 or horizon <= 0:
        return ()
    per_s = total * len(handles) / DAY_S
    cumulative = list(itertools.accumulate(rates))
    last = len(model.causes) - 1
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(per_s)
        if t >= horizon:
            break
        cause = model.causes[min(bisect.bisect_right(cumulative, rng.random() * total), last)]
        node = handles[rng.randrange(len(handles))]
        precursor: float | None = None
        if cause.precursor_fraction > 0 and rng.random() < cause.precursor_fraction:
            at = t - sample(cause.lead_time, rng)
            precursor = at if at >= 0 else None
        faults.append(
            Fault(
                fault_id=len(faults) + 1,
                node=node,
                at_s=t,
                cause=cause.name,
                kind=cause.kind,
                signal=cause.signal,
                precursor_at_s=precursor,
                repair_s=sample(cause.repair, rng),
            )
        )
    return tuple(faults)


def draw_planned(
    model: FailureModel, nodes: Sequence[NodeLike], days: float, rng: random.Random
) -> tuple[PlannedMaintenance, ...]:
    """One run's planned maintenance: a Poisson process of rate
    ``planned_rate_per_node_day`` per node (exponential gaps over all nodes, the node
    uniformly), each lasting a draw of ``planned_duration``; sorted by time."""
    out: list[PlannedMaintenance] = []
    for t, node in _arrivals(_handles(nodes), model.planned_rate_per_node_day, days, rng):
        duration = sample(model.planned_duration, rng)
        out.append(PlannedMaintenance(node=node, at_s=t, duration_s=duration))
    return tuple(out)


def _arrivals(
    handles: Sequence[str], rate_per_node_day: float, days: float, rng: random.Random
) -> Iterator[tuple[float, str]]:
    """A Poisson process of ``rate_per_node_day`` per node over ``days``: exponential
    gaps over all nodes, the node uniformly; (time, node) in time order (the caller's
    draws for each come between two arrivals' draws)."""
    horizon = days * DAY_S
    if not handles or rate_per_node_day <= 0 or horizon <= 0:
        return
    per_s = rate_per_node_day * len(handles) / DAY_S
    t = 0.0
    while True:
        t += rng.expovariate(per_s)
        if t >= horizon:
            return
        yield t, handles[rng.randrange(len(handles))]


def sample_slowdown(dist: Slowdown, rng: random.Random) -> float:
    """One draw of a slowdown (>= 0)."""
    if dist.kind == "lognormal":
        value = dist.median * math.exp(dist.sigma * rng.normalvariate(0.0, 1.0))
        return min(max(value, dist.low), dist.high)
    if len(dist.values) == 1:
        return dist.values[0]
    cumulative = list(itertools.accumulate(dist.weights))
    at = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
    return dist.values[min(at, len(dist.values) - 1)]


def draw_stragglers(
    model: StragglerModel, nodes: Sequence[NodeLike], days: float, rng: random.Random
) -> tuple[Straggler, ...]:
    """One run's fail-slow episodes: a Poisson process of ``rate_per_node_day`` per node
    (exponential gaps over all nodes, the node uniformly), each with its slowdown, how long
    it lasts if nothing acts on it and its repair; sorted by time, ids 1, 2, ... Drawn
    from their own ``rng`` (``<seed>:stragglers``): the faults are the same with or
    without them."""
    out: list[Straggler] = []
    for t, node in _arrivals(_handles(nodes), model.rate_per_node_day, days, rng):
        out.append(
            Straggler(
                straggler_id=len(out) + 1,
                node=node,
                at_s=t,
                slowdown=sample_slowdown(model.slowdown, rng),
                duration_s=sample(model.duration, rng),
                repair_s=sample(model.repair, rng),
            )
        )
    return tuple(out)


def with_straggler_rate(model: FailureModel, rate_per_node_day: float) -> FailureModel:
    """``model`` with its stragglers at ``rate_per_node_day`` (the default slowdown,
    duration and repair where the model had no ``[stragglers]``)."""
    stragglers = dataclasses.replace(model.stragglers, rate_per_node_day=rate_per_node_day)
    return dataclasses.replace(model, stragglers=stragglers)


# --- for the report -------------------------------------------------------------------


def distribution_dict(dist: Distribution) -> dict[str, object]:
    """A distribution as plain JSON values (``sigma`` only for a lognormal)."""
    out: dict[str, object] = {"kind": dist.kind, "mean_s": dist.mean_s}
    if dist.kind == "lognormal":
        out["sigma"] = dist.sigma
    return out


def slowdown_dict(dist: Slowdown) -> dict[str, object]:
    """A slowdown distribution as plain JSON values, with its mean."""
    out: dict[str, object] = {"kind": dist.kind, "mean": dist.mean}
    if dist.kind == "lognormal":
        out.update(median=dist.median, sigma=dist.sigma, min=dist.low, max=dist.high)
    elif dist.kind == "fixed":
        out["value"] = dist.values[0]
    else:
        out.update(values=list(dist.values), weights=list(dist.weights))
    return out


def stragglers_dict(model: StragglerModel) -> dict[str, object]:
    """The straggler model as plain JSON values."""
    return {
        "rate_per_node_day": model.rate_per_node_day,
        "slowdown": slowdown_dict(model.slowdown),
        "duration": distribution_dict(model.duration),
        "repair": distribution_dict(model.repair),
    }


def model_dict(model: FailureModel) -> dict[str, object]:
    """The model as plain JSON values: source, totals, planned maintenance, per cause (by
    name) its rate, share of the total, kind, signal, precursor fraction, lead time and
    repair, and the stragglers."""
    total = model.total_rate_per_node_day
    return {
        "stragglers": stragglers_dict(model.stragglers),
        "source": model.source,
        "total_rate_per_node_day": total,
        "planned_rate_per_node_day": model.planned_rate_per_node_day,
        "planned_duration": distribution_dict(model.planned_duration),
        "causes": {
            c.name: {
                "rate_per_node_day": c.rate_per_node_day,
                "share": c.rate_per_node_day / total if total else 0.0,
                "kind": c.kind,
                "signal": c.signal,
                "precursor_fraction": c.precursor_fraction,
                "lead_time": distribution_dict(c.lead_time),
                "repair": distribution_dict(c.repair),
            }
            for c in model.causes
        },
    }
