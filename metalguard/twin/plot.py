"""The fleet twin's figure: utilisation and running jobs over time, one line per policy,
the faults marked on the time axis (a PNG, matplotlib's Agg backend).

matplotlib is an optional dependency (``pip install 'metalguard[twin]'``): it is imported
only when a figure is drawn, and its absence is a :class:`PlotUnavailableError`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from metalguard.twin.model import DAY_S, TwinResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

INSTALL_HINT = "pip install 'metalguard[twin]'"

FAULT_COLOURS = {"hardware": "tab:red", "software": "tab:gray", "hang": "tab:purple"}
FAULT_BANDS = {"hardware": (0.0, 0.045), "software": (0.05, 0.095), "hang": (0.1, 0.145)}
"""Where each kind's ticks stand, in axes fractions from the bottom (a rug per kind)."""
POLICY_COLOURS = {"static": "tab:blue", "reactive": "tab:orange", "metalguard": "tab:green"}


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed (the message says how to install it)."""


def require_matplotlib() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend, or :class:`PlotUnavailableError`."""
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:
        raise PlotUnavailableError(
            f"the figure needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from exc


def plot(results: Sequence[TwinResult], path: Path | str) -> None:
    """Draw ``results`` (one or more policies on the same inputs) into the PNG ``path``:
    utilisation (busy GPUs / the fleet's GPUs) above, running jobs below, every fault a
    tick at the bottom of both axes (a band and a colour per kind)."""
    if not results:
        raise ValueError("plot needs at least one result")
    plt = require_matplotlib()
    fig, (util_ax, jobs_ax) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), dpi=110)
    try:
        for result in results:
            gpus = sum(n.gpus for n in result.inputs.nodes)
            days = [p.t_s / DAY_S for p in result.timeline]
            util = [100 * p.busy_gpus / gpus if gpus else 0.0 for p in result.timeline]
            running = [p.running_jobs for p in result.timeline]
            name = result.policy.name
            colour = POLICY_COLOURS.get(name)
            allocation = result.inputs.allocation
            label = f"{allocation} ({name})" if allocation else name
            util_ax.step(days, util, where="post", label=label, color=colour, linewidth=1.2)
            jobs_ax.step(days, running, where="post", label=label, color=colour, linewidth=1.2)
        first = results[0]
        for ax in (util_ax, jobs_ax):
            _fault_rug(ax, first)
            ax.grid(True, alpha=0.3)
        util_ax.set_ylabel("utilisation (%)")
        util_ax.set_ylim(0, 100)
        jobs_ax.set_ylabel("running jobs")
        jobs_ax.set_ylim(bottom=0)
        jobs_ax.set_xlabel("simulated days")
        jobs_ax.set_xlim(0, first.inputs.days)
        util_ax.legend(loc="upper right", fontsize="small")
        inputs = first.inputs
        util_ax.set_title(
            f"fleet twin: {len(inputs.nodes):,} nodes, {len(first.jobs):,} jobs submitted, "
            f"{inputs.days:g} days, seed {inputs.seed}; "
            f"ticks: {len(first.faults):,} faults (red hardware, grey software, "
            f"purple hang)",
            fontsize="small",
        )
        fig.tight_layout()
        fig.savefig(Path(path), format="png")
    finally:
        plt.close(fig)


def _fault_rug(ax: Axes, result: TwinResult) -> None:
    """A short vertical tick per fault at the bottom of ``ax``, a band per kind."""
    by_kind: dict[str, list[float]] = {}
    for fault in result.faults:
        by_kind.setdefault(fault.kind, []).append(fault.at_s / DAY_S)
    for kind in sorted(by_kind):
        low, high = FAULT_BANDS.get(kind, (0.0, 0.045))
        ax.vlines(
            by_kind[kind],
            low,
            high,
            transform=ax.get_xaxis_transform(),
            colors=FAULT_COLOURS.get(kind, "black"),
            linewidth=0.8,
        )
