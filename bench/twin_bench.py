"""The fleet twin's speed: simulated days of a large fleet per wall second (docs/twin.md).

Builds the inputs as ``metalguard twin run`` does (a fleet of ``--nodes`` nodes, the gang
generator's jobs and an optional ``--trace``, the default failure model: Llama 3's cause
mix) and times one run of the engine (metalguard.twin.engine.run) under ``--policy``
(default metalguard), then prints the wall and CPU seconds, the events and events per
second, and the report's utilisation, fleet ETTR and interruptions.

``--sizes 1000x30,10000x90,100000x30`` runs each NODESxDAYS in a fresh subprocess (no
warm caches, memory returned between sizes) and prints one table with the issue's goals
(10,000 nodes x 90 days <= 300 s, 100,000 x 30 <= 1,800 s, on the 2-core machine) and the
ratios of the wall and the CPU seconds to the goal (the machine is shared: the CPU
time is the figure an idle machine would show). ``--profile`` runs the engine under
cProfile and prints the top-20 entries (by own time, and by cumulative time).

Usage: python bench/twin_bench.py [--nodes 1000] [--days 30] [--policy metalguard]
           [--seed 1] [--trace FILE] [--profile] [--sizes 1000x30,10000x90]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from typing import Any

GOALS_S: dict[tuple[int, float], float] = {(10_000, 90.0): 300.0, (100_000, 30.0): 1800.0}
"""The issue's goals: (nodes, days) -> wall seconds."""

RESULT = "RESULT "
"""The machine-readable line a single run ends with (read by ``--sizes``)."""


def parse_sizes(text: str) -> list[tuple[int, float]]:
    """``"1000x30,10000x90"`` -> ``[(1000, 30.0), (10000, 90.0)]``."""
    sizes = []
    for part in text.split(","):
        nodes, _, days = part.strip().lower().partition("x")
        if not days:
            raise argparse.ArgumentTypeError(f"{part!r}: want NODESxDAYS, e.g. 10000x90")
        sizes.append((int(nodes.replace("_", "")), float(days)))
    return sizes


def measure(
    nodes: int, days: float, policy_name: str, seed: int, trace: str | None, profile: bool
) -> dict[str, Any]:
    """Build the inputs, run the engine once, and return the figures."""
    from metalguard.twin.cli import build_inputs
    from metalguard.twin.engine import run
    from metalguard.twin.policies import POLICIES
    from metalguard.twin.report import build_report

    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    inputs = build_inputs(str(nodes), days=days, seed=seed, trace=trace)
    build_s = time.perf_counter() - t0
    policy = POLICIES[policy_name]  # type: ignore[index]
    profiler = cProfile.Profile() if profile else None
    t1, c1 = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    result = run(inputs, policy)
    if profiler is not None:
        profiler.disable()
    wall_s, cpu_s = time.perf_counter() - t1, time.process_time() - c1
    report = build_report(result)
    figures: dict[str, Any] = {
        "nodes": nodes,
        "days": days,
        "policy": policy_name,
        "seed": seed,
        "jobs": len(inputs.jobs),
        "faults": len(result.faults),
        "build_s": build_s,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "total_cpu_s": time.process_time() - c0,
        "events": result.events,
        "events_per_s": result.events / wall_s if wall_s > 0 else None,
        "utilisation": report["utilisation"],
        "ettr": report["ettr"]["fleet"],
        "unplanned": report["interruptions"]["unplanned"],
        "planned": report["interruptions"]["planned"],
        "finished": report["jobs"]["finished"],
        "load": [load0, os.getloadavg()[0]],
    }
    if profiler is not None:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(20)
            text = out.getvalue()
            print(f"--- profile: top 20 by {key}")
            print(text[text.find("   ncalls") :].rstrip())  # from the column headers on
    return figures


def _goal(nodes: int, days: float) -> float | None:
    return GOALS_S.get((nodes, float(days)))


def print_one(f: dict[str, Any]) -> None:
    """A single run's figures, one per line."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f} %"

    print(
        f"twin: {f['nodes']:,} nodes x {f['days']:g} days, policy {f['policy']}, "
        f"seed {f['seed']}: {f['jobs']:,} jobs, {f['faults']:,} faults"
    )
    print(f"inputs built in {f['build_s']:.1f} s")
    print(f"engine: {f['wall_s']:.1f} s wall, {f['cpu_s']:.1f} s CPU")
    rate = f["events_per_s"]
    print(f"events: {f['events']:,} ({rate:,.0f}/s)" if rate else f"events: {f['events']:,}")
    print(
        f"utilisation {pct(f['utilisation'])}, ettr {pct(f['ettr'])}, interruptions "
        f"{f['unplanned']:,} unplanned / {f['planned']:,} planned, "
        f"{f['finished']:,} jobs finished"
    )
    print(f"load average {f['load'][0]:.2f} before, {f['load'][1]:.2f} after")
    goal = _goal(f["nodes"], f["days"])
    if goal is not None:
        verdict = "meets" if f["wall_s"] <= goal else "MISSES"
        print(
            f"{f['wall_s']:.1f} s wall ({f['cpu_s']:.1f} s CPU) against the {goal:.0f} s "
            f"goal: {verdict} it"
        )


def run_sizes(args: argparse.Namespace) -> int:
    """Each size in a fresh subprocess; one table."""
    rows: list[dict[str, Any]] = []
    for nodes, days in args.sizes:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--nodes",
            str(nodes),
            "--days",
            repr(days),
            "--policy",
            args.policy,
            "--seed",
            str(args.seed),
        ]
        if args.trace:
            cmd += ["--trace", args.trace]
        print(f"running {nodes:,} x {days:g} days ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if proc.returncode != 0 or not lines:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            print(f"{nodes} x {days:g}: failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1].removeprefix(RESULT)))
    print(
        f"{'nodes':>8} {'days':>5} {'jobs':>6} {'faults':>7} {'events':>10} {'events/s':>9} "
        f"{'wall s':>8} {'cpu s':>8} {'goal s':>7} {'wall/g':>6} {'cpu/g':>6} {'util':>6} "
        f"{'ettr':>6} "
        f"{'unpl.':>6} {'load':>5}"
    )
    for r in rows:
        goal = _goal(r["nodes"], r["days"])
        ratio = f"{r['wall_s'] / goal:.2f}" if goal else "-"
        cpu_ratio = f"{r['cpu_s'] / goal:.2f}" if goal else "-"
        util = f"{100 * r['utilisation']:.1f}" if r["utilisation"] is not None else "n/a"
        ettr = f"{100 * r['ettr']:.1f}" if r["ettr"] is not None else "n/a"
        print(
            f"{r['nodes']:>8,} {r['days']:>5g} {r['jobs']:>6,} {r['faults']:>7,} "
            f"{r['events']:>10,} {r['events_per_s'] or 0:>9,.0f} {r['wall_s']:>8.1f} "
            f"{r['cpu_s']:>8.1f} {goal or '-':>7} {ratio:>6} {cpu_ratio:>6} {util:>6} {ettr:>6} "
            f"{r['unplanned']:>6,} {max(r['load']):>5.1f}"
        )
    return 0


def main() -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument(
        "--policy", choices=("static", "reactive", "metalguard"), default="metalguard"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trace", help="an Alibaba pod list (the gang generator's jobs too)")
    parser.add_argument("--profile", action="store_true", help="print the top-20 cProfile entries")
    parser.add_argument(
        "--sizes", type=parse_sizes, help="NODESxDAYS,... each in a fresh subprocess, one table"
    )
    args = parser.parse_args()
    if args.sizes:
        return run_sizes(args)
    figures = measure(args.nodes, args.days, args.policy, args.seed, args.trace, args.profile)
    print_one(figures)
    print(RESULT + json.dumps(figures, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
