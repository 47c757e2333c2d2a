"""A soak: the demo fleet with random faults and jobs for a chosen time, sampled every
minute, then its events and jobs checked for loss and duplicates (docs/benchmarks.md
"Soak").

Runs ``metalguard demo --headless`` as a child over a scenario this script generates
(seeded): random faults of every known kind (metalguard/demo/sim/faults.py) on random
nodes at random times, within the safety rail's limit (at most 3 FAILING per 32-node
cluster in any hour: ``max(1, floor(10 % x size))``), and random jobs running
examples/trainer.py.  Every ``--sample-s`` it records the demo process's RSS, open file
descriptors and threads (/proc), the nats-server's RSS, the job members running, and,
from the demo's ``/metrics``, the asyncio task count and the event-loop lag p99 / max.
At the end (before it stops the demo with SIGTERM) it reads the whole ``<P>_CONTROL``
stream and checks it against the demo's ``--report``: every event id once in each,
nothing in one that is missing from the other, no node isolated more often than it got
a FAILING fault, and every job the demo submitted in the report once, in a known state.

Usage: python bench/soak.py [--minutes 60] [--sample-s 60] [--out soak.json] [--seed N]
Exit status 0 when nothing was lost or duplicated and the demo exited 0 with its report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from prometheus_client.parser import text_string_to_metric_families

from metalguard.demo.sim.faults import KNOWN_KINDS
from metalguard.demo.sim.fleet import is_infiniband
from metalguard.proto.codec import CodecError, decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobState
from metalguard.proto.subjects import Subjects

FAILING_KINDS = (
    "ecc_ue",
    "aer_fatal",
    "smart_fail",
    "fan_stop",
    "rdma_port_down",
    "gpu_xid_reboot",
)
SUB_HEALTHY_KINDS = (
    "ecc_ce_storm",
    "pcie_downgrade",
    "rdma_link_flap",
    "rdma_symbol_errors",
)
NO_CHANGE_KINDS = ("dcqcn_no_cnp", "iommu_shared")
"""Kinds that change no grade (a QoS finding, docs/qos.md; a DMA isolation posture,
docs/security.md): planned with no ``expect``."""
GPU_KINDS = (
    "gpu_xid_app",
    "gpu_xid_ignore",
    "gpu_xid_attention",
    "gpu_xid_reset",
    "gpu_xid_decode",
    "gpu_remap_pending",
)
"""GPU faults judged by nothing here (docs/decisions.md "GPU"): XIDs that cost nothing or
10 points, and the ones whose node is reset once drained and back HEALTHY (SUB_HEALTHY
for seconds, or as long as a job runs there): planned with no ``expect``, one an hour per
cluster. ``gpu_xid_reboot`` isolates: a FAILING kind."""
EXPECT: dict[str, str | None] = {
    **dict.fromkeys(FAILING_KINDS, "FAILING"),
    **dict.fromkeys(SUB_HEALTHY_KINDS, "SUB_HEALTHY"),
    **dict.fromkeys(NO_CHANGE_KINDS),
    **dict.fromkeys(GPU_KINDS),
    "agent_kill": "UNREACHABLE",
}
UNPLANNED = frozenset({"kmsg", "straggler"})
"""Kinds the soak does not draw: a kernel-log fault needs its line (the default scenario
and tests/integration/test_kmsg_agent.py cover it); a straggler shows only through a
running job's timings (the default scenario and tests/integration/test_demo_straggler.py
cover it)."""
assert set(EXPECT) | UNPLANNED == set(KNOWN_KINDS), "a fault kind the soak does not know"
ROCE_KINDS = frozenset({"dcqcn_no_cnp"})
"""Kinds that need a RoCE node (racks k2, k4, ... of the demo's mixed fabric)."""
RAIL_FRACTION = 0.1
"""The rail's default ``rail_max_fraction`` (docs/lifecycle.md "The safety rail")."""
RAIL_WINDOW_S = 3600.0
RAIL_MARGIN_S = 120.0
"""FAILING faults of a cluster are spaced so that no window of the rail's hour plus this
(detection takes a few seconds; fan_stop ~15 s) holds more than the rail's limit."""
JOB_STATES: frozenset[str] = frozenset(JobState.__args__)  # type: ignore[attr-defined]
STEP_S = 0.05
"""examples/trainer.py's default ``--step-seconds``."""
PREFIX = "mg"
RUNNING = "running; press Ctrl-C to stop"


# --- the scenario (pure) ------------------------------------------------------------


def rail_limit(cluster_size: int) -> int:
    """How many nodes of a cluster the rail lets automatic isolation take per hour."""
    return max(1, math.floor(RAIL_FRACTION * cluster_size))


def spaced(times: list[float], limit: int, window_s: float) -> list[float]:
    """The sorted ``times`` kept greedily so that no ``window_s`` holds more than
    ``limit`` of them."""
    kept: list[float] = []
    for t in sorted(times):
        if len(kept) < limit or t - kept[-limit] >= window_s:
            kept.append(t)
    return kept


@dataclass(frozen=True)
class Fleet:
    """The demo fleet's shape (``metalguard demo`` flags)."""

    regions: int = 2
    clusters: int = 1
    racks: int = 4
    nodes_per_rack: int = 8

    @property
    def cluster_size(self) -> int:
        return self.racks * self.nodes_per_rack

    def cluster_nodes(self) -> dict[str, list[str]]:
        """``r1c1`` → its node names (``r1c1k1n1`` ...)."""
        return {
            f"r{r}c{c}": [
                f"r{r}c{c}k{k}n{n}"
                for k in range(1, self.racks + 1)
                for n in range(1, self.nodes_per_rack + 1)
            ]
            for r in range(1, self.regions + 1)
            for c in range(1, self.clusters + 1)
        }


def is_roce(node: str) -> bool:
    """Whether a demo node (``r1c1k2n3``) has RoCE NICs (its rack's, docs/simulation.md)."""
    return not is_infiniband(int(node[node.index("k") + 1 : node.index("n")]))


def take_node(free: list[str], kind: str) -> str | None:
    """The first node of ``free`` the kind can hit (a RoCE one for a DCQCN fault), taken
    out of the list; None when none is left."""
    for i, node in enumerate(free):
        if kind not in ROCE_KINDS or is_roce(node):
            return free.pop(i)
    return None


def plan_faults(rng: random.Random, fleet: Fleet, duration_s: float) -> list[dict[str, Any]]:
    """Random faults per cluster, each on its own node, between 10 s and 85 % of the run:
    per hour (or per run when shorter) the rail's limit of FAILING kinds, about 3 per 32
    nodes of SUB_HEALTHY kinds, one of a kind that changes no grade and one agent_kill; at
    most half of a cluster's nodes.  A fault without an expected grade has ``expect``
    None (left out of the scenario file: not judged)."""
    hours = max(1, math.ceil(duration_s / RAIL_WINDOW_S))
    lo, hi = 10.0, max(11.0, 0.85 * duration_s)
    size = fleet.cluster_size
    out: list[dict[str, Any]] = []
    for nodes in fleet.cluster_nodes().values():
        free = rng.sample(nodes, len(nodes) // 2)
        failing = spaced(
            [rng.uniform(lo, hi) for _ in range(rail_limit(size) * hours)],
            rail_limit(size),
            RAIL_WINDOW_S + RAIL_MARGIN_S,
        )
        picks = [(t, rng.choice(FAILING_KINDS)) for t in failing]
        picks += [
            (rng.uniform(lo, hi), rng.choice(SUB_HEALTHY_KINDS))
            for _ in range(max(1, round(size * 3 / 32)) * hours)
        ]
        picks += [(rng.uniform(lo, hi), rng.choice(NO_CHANGE_KINDS)) for _ in range(hours)]
        picks += [(rng.uniform(lo, hi), "agent_kill") for _ in range(hours)]
        picks += [(rng.uniform(lo, hi), rng.choice(GPU_KINDS)) for _ in range(hours)]
        for t, kind in sorted(picks):
            node = take_node(free, kind)
            if node is not None:
                out.append({"at": round(t, 1), "node": node, "kind": kind, "expect": EXPECT[kind]})
    return sorted(out, key=lambda f: (f["at"], f["node"]))


def plan_jobs(
    rng: random.Random, fleet: Fleet, duration_s: float, every_s: float
) -> list[dict[str, Any]]:
    """Random trainer jobs, one every ``every_s`` on average (exponential gaps) from 5 s
    to 90 % of the run: 1-4 nodes, 10 s to 2 min of steps, random priority, preemption
    and region."""
    jobs: list[dict[str, Any]] = []
    t = 5.0
    while t <= 0.9 * duration_s:
        steps = rng.randint(200, 2400)
        jobs.append(
            {
                "at": round(t, 1),
                "name": f"soak-{len(jobs) + 1:03d}",
                "nodes": rng.randint(1, min(4, fleet.cluster_size)),
                "priority": rng.randint(0, 2),
                "preemptible": rng.random() < 0.5,
                "args": ["examples/trainer.py", "--steps", str(steps)],
                "checkpoint_every": 5,
                "max_restarts": 3,
                "region": f"r{rng.randint(1, fleet.regions)}",
            }
        )
        t += rng.expovariate(1.0 / every_s)
    return jobs


def scenario_toml(faults: list[dict[str, Any]], jobs: list[dict[str, Any]], seed: int) -> str:
    """The scenario file (metalguard/demo/sim/scenario.py) for these faults and jobs."""
    lines = [f'description = "soak (seed {seed}): {len(faults)} faults, {len(jobs)} jobs"', ""]
    for table, entries in (("fault", faults), ("job", jobs)):
        for entry in entries:
            lines.append(f"[[{table}]]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items() if v is not None]
            lines.append("")
    return "\n".join(lines)


# --- the checks and figures (pure) ----------------------------------------------------


def repeats(ids: list[str]) -> int:
    """How many entries of ``ids`` repeat an earlier one."""
    return len(ids) - len(set(ids))


def check_events(
    stream: list[dict[str, Any]],
    report: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    cutoff_t: float,
) -> dict[str, Any]:
    """Loss and duplicates between the ``<P>_CONTROL`` stream read up to the cutoff and
    the report's events (those the report got by ``cutoff_t`` must be in the stream; every
    stream event must be in the report), and node.isolated per FAILING fault."""
    stream_ids = [e["id"] for e in stream]
    report_ids = [e.get("id") or "" for e in report]
    in_stream, in_report = set(stream_ids), set(report_ids)
    not_reported = sorted(in_stream - in_report)
    not_stored = sorted(
        e["id"] for e in report if e["t"] <= cutoff_t and e.get("id") not in in_stream
    )
    failing = Counter(f["node"] for f in faults if f["expect"] == "FAILING")
    unique = {e["id"]: e for e in stream}.values()
    isolated = Counter(e["node"] for e in unique if e["kind"] == "node.isolated")
    twice = {n: k for n, k in isolated.items() if failing[n] and k > failing[n]}
    return {
        "stream_events": len(stream_ids),
        "report_events": len(report_ids),
        "by_kind": dict(sorted(Counter(e["kind"] for e in unique).items())),
        "duplicated_in_stream": repeats(stream_ids),
        "duplicated_in_report": repeats(report_ids),
        "isolated_twice_for_one_fault": twice,
        "isolated_without_fault": sorted(n for n in isolated if not failing[n]),
        "missing_from_report": not_reported,
        "missing_from_stream": not_stored,
        "lost": len(not_reported) + len(not_stored),
        "duplicated": repeats(stream_ids) + repeats(report_ids) + sum(twice.values()),
    }


def check_jobs(submitted: dict[str, str], report: dict[str, Any]) -> dict[str, Any]:
    """Every job the demo said it submitted (name → id) in the report once, with that
    id and a known state; the report's rows match ``jobs_submitted``."""
    rows = report.get("jobs", [])
    ids = [r["id"] for r in rows]
    by_id = {r["id"]: r for r in rows}
    missing = sorted(n for n, i in submitted.items() if i not in by_id)
    unknown = sorted(r["name"] for r in rows if r["state"] not in JOB_STATES)
    states = Counter(r["state"] for r in rows)
    return {
        "submitted": len(submitted),
        "reported": len(rows),
        "jobs_submitted_field": report.get("jobs_submitted"),
        "states": dict(sorted(states.items())),
        "terminal": sum(n for s, n in states.items() if s in TERMINAL_JOB_STATES),
        "failed_reasons": sorted({r["reason"] for r in rows if r["state"] == "failed"}),
        "missing": missing,
        "unknown_state": unknown,
        "duplicated": repeats(ids) + repeats([r["name"] for r in rows]),
        "lost": len(missing)
        + len(unknown)
        + abs(len(rows) - int(report.get("jobs_submitted", len(rows)))),
    }


def growth_per_hour(samples: list[dict[str, Any]], key: str, warmup_s: float) -> float | None:
    """The slope (per hour) of a least-squares line through ``key`` over the samples at or
    after ``warmup_s``; None with fewer than two."""
    points = [(s["t_s"], s[key]) for s in samples if s["t_s"] >= warmup_s and s[key] is not None]
    if len(points) < 2 or len({t for t, _ in points}) < 2:
        return None
    slope, _ = statistics.linear_regression([t for t, _ in points], [v for _, v in points])
    return slope * 3600.0


def figures(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """RSS growth per hour, lag p99 and max, and the first/last task and fd counts after
    the warm-up."""
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    rss = growth_per_hour(samples, "rss_mb", warmup_s)
    p99 = [s["lag_p99_s"] for s in after if s["lag_p99_s"] is not None]
    lag_max = [s["lag_max_s"] for s in samples if s["lag_max_s"] is not None]
    first, last = after[0], after[-1]
    return {
        "warmup_s": warmup_s,
        "rss_growth_mb_per_h": None if rss is None else round(rss, 2),
        "rss_mb_first": first["rss_mb"],
        "rss_mb_last": last["rss_mb"],
        "lag_p99_s_max": max(p99) if p99 else None,
        "lag_p99_s_last": p99[-1] if p99 else None,
        "lag_max_s": max(lag_max) if lag_max else None,
        "tasks_first": first["tasks"],
        "tasks_last": last["tasks"],
        "fds_first": first["fds"],
        "fds_last": last["fds"],
    }


# --- sampling (I/O) -------------------------------------------------------------------


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def proc_sample(pid: int) -> dict[str, Any]:
    """The demo process's RSS (MB), open fds and threads; the nats-server child's RSS and
    the job members (children running trainer.py)."""
    status = _status(pid)
    nats_rss, members = None, 0
    for kid in _children(pid):
        try:
            comm = Path(f"/proc/{kid}/comm").read_text().strip()
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
            if comm == "nats-server":
                nats_rss = int(_status(kid)["VmRSS"].split()[0]) / 1024
            elif b"trainer.py" in cmdline:
                members += 1
        except (OSError, KeyError):
            continue
    return {
        "rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "nats_rss_mb": None if nats_rss is None else round(nats_rss, 1),
        "members": members,
    }


METRICS = {
    "metalguard_asyncio_tasks": "tasks",
    "metalguard_event_loop_lag_p99_seconds": "lag_p99_s",
    "metalguard_event_loop_lag_max_seconds": "lag_max_s",
}


async def metrics_sample(http: aiohttp.ClientSession, api: str) -> dict[str, Any]:
    """The task count and lag figures from the demo's ``/metrics`` (None when absent)."""
    out: dict[str, Any] = dict.fromkeys(METRICS.values())
    try:
        async with http.get(f"{api}/metrics", timeout=aiohttp.ClientTimeout(total=20)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in METRICS:
                value = s.value
                out[METRICS[s.name]] = int(value) if s.name.endswith("tasks") else value
    return out


# --- the demo child ---------------------------------------------------------------------


class Demo:
    """``metalguard demo --headless`` as a child; stdout read line by line on a thread."""

    def __init__(self, workdir: Path, scenario: Path, fleet: Fleet, duration_s: float) -> None:
        self.report = workdir / "report.json"
        command = [
            sys.executable, "-m", "metalguard", "demo", "--headless",
            "--duration", str(duration_s), "--regions", str(fleet.regions),
            "--clusters", str(fleet.clusters), "--racks", str(fleet.racks),
            "--nodes-per-rack", str(fleet.nodes_per_rack), "--scenario", str(scenario),
            "--report", str(self.report), "--http", "127.0.0.1:0", "--prefix", PREFIX,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.submitted: dict[str, str] = {}
        self.rejected: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if m := SUBMITTED.search(line):
                self.submitted[m.group(1)] = m.group(2)
            elif m := REJECTED.search(line):
                self.rejected.append(m.group(1))
            self.lines.put(line)

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first later line matching ``pattern``; RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if m := pattern.search(line):
                return m
        raise RuntimeError(f"demo: no {pattern.pattern!r}:\n{''.join(self.output[-30:])}")

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then wait (SIGKILL after ``timeout_s``); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


NATS_AT = re.compile(r"NATS at (nats://\S+)")
API_AT = re.compile(r"API at (http://\S+)")
SUBMITTED = re.compile(r"job (\S+) submitted as (\S+)")
REJECTED = re.compile(r"job (\S+) rejected")


@dataclass
class StreamReader:
    """Every ControllerEvent in ``<P>_CONTROL``, from its first message (an ordered
    consumer): id, stream sequence, kind, node."""

    events: list[dict[str, Any]] = field(default_factory=list)
    last_seq: int = 0
    undecodable: int = 0
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_seq(self, seq: int, timeout_s: float) -> bool:
        """Wait until the message at stream sequence ``seq`` was read; whether it was."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.last_seq < seq:
                    self.moved.clear()
                    await self.moved.wait()
        return self.last_seq >= seq

    async def on_msg(self, msg: Msg) -> None:
        self.last_seq = max(self.last_seq, msg.metadata.sequence.stream)
        self.moved.set()
        try:
            event = decode(msg.data, ControllerEvent)
        except CodecError:
            self.undecodable += 1
            return
        self.events.append(
            {
                "id": event.event_id,
                "seq": msg.metadata.sequence.stream,
                "kind": event.kind,
                "node": event.node.node if event.node else None,
            }
        )


@dataclass
class Options:
    minutes: float
    sample_s: float
    warmup_s: float
    seed: int
    job_every_s: float
    fleet: Fleet
    out: Path | None


async def soak(options: Options, workdir: Path) -> dict[str, Any]:
    """Run the soak; the result document (samples, figures, checks)."""
    duration_s = options.minutes * 60.0
    rng = random.Random(options.seed)
    faults = plan_faults(rng, options.fleet, duration_s)
    jobs = plan_jobs(rng, options.fleet, duration_s, options.job_every_s)
    scenario = workdir / "soak-scenario.toml"
    scenario.write_text(scenario_toml(faults, jobs, options.seed))
    print(
        f"soak: seed {options.seed}, {len(faults)} faults, {len(jobs)} jobs, "
        f"{options.minutes:g} min, a sample every {options.sample_s:g} s",
        flush=True,
    )
    demo = Demo(workdir, scenario, options.fleet, duration_s + 300.0)  # a backstop
    subjects = Subjects(PREFIX)
    reader = StreamReader()
    samples: list[dict[str, Any]] = []
    try:
        url = demo.wait_for(NATS_AT, 60).group(1)
        api = demo.wait_for(API_AT, 60).group(1)
        nc = await nats.connect(url, allow_reconnect=False)
        await nc.jetstream().subscribe(
            subjects.all_of("ctl"),
            stream=subjects.stream_control,
            cb=reader.on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        await asyncio.to_thread(demo.wait_for, re.compile(re.escape(RUNNING)), 180)
        t0 = time.monotonic()
        print(f"soak: the fleet is up; API {api}", flush=True)
        print(HEADER, flush=True)
        async with aiohttp.ClientSession() as http:
            k = 0
            while True:
                due = t0 + k * options.sample_s
                if due > t0 + duration_s + 1e-6:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if demo.proc.poll() is not None:
                    raise RuntimeError(f"the demo exited early ({demo.proc.returncode})")
                row = {"t_s": round(time.monotonic() - t0, 1)}
                row |= proc_sample(demo.proc.pid) | await metrics_sample(http, api)
                samples.append(row)
                print(_row(row), flush=True)
                k += 1
        cutoff_t = time.monotonic() - t0
        info = await nc.jetstream().stream_info(subjects.stream_control)
        await reader.wait_seq(info.state.last_seq, 30.0)
        await nc.close()
    finally:
        status = await asyncio.to_thread(demo.stop, 30.0)
    report = json.loads(demo.report.read_text()) if demo.report.is_file() else {}
    applied = [f for f in faults if f["at"] <= cutoff_t]
    events = check_events(reader.events, report.get("events", []), applied, cutoff_t)
    job_checks = check_jobs(demo.submitted, report)
    return {
        "seed": options.seed,
        "minutes": options.minutes,
        "sample_s": options.sample_s,
        "fleet": vars(options.fleet),
        "faults": faults,
        "jobs_planned": len(jobs),
        "jobs_rejected": demo.rejected,
        "samples": samples,
        "figures": figures(samples, options.warmup_s),
        "events": events | {"undecodable": reader.undecodable},
        "jobs": job_checks,
        "demo": {
            "exit_status": status,
            "report": bool(report),
            "report_ok": report.get("ok"),
            "stop_lag_s": report.get("stop_lag_s"),
            "stopped_by": report.get("stopped_by"),
            "output_tail": "" if status == 0 else "".join(demo.output[-40:]),
        },
        "lost": events["lost"] + job_checks["lost"],
        "duplicated": events["duplicated"] + job_checks["duplicated"],
    }


HEADER = (
    f"{'t_s':>7} {'rss_mb':>7} {'fds':>5} {'thr':>4} {'tasks':>6} "
    f"{'lag_p99_ms':>10} {'lag_max_ms':>10} {'nats_mb':>7} {'members':>7}"
)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _row(s: dict[str, Any]) -> str:
    return (
        f"{s['t_s']:>7.1f} {s['rss_mb']:>7.1f} {s['fds']:>5} {s['threads']:>4} "
        f"{s['tasks'] if s['tasks'] is not None else '-':>6} {_ms(s['lag_p99_s']):>10} "
        f"{_ms(s['lag_max_s']):>10} {s['nats_rss_mb'] or '-':>7} {s['members']:>7}"
    )


def summary(doc: dict[str, Any]) -> str:
    """The end-of-run figures and checks, as lines."""
    f, e, j, d = doc["figures"], doc["events"], doc["jobs"], doc["demo"]
    growth = f["rss_growth_mb_per_h"]
    return "\n".join(
        [
            f"RSS growth after {f['warmup_s']:g} s warm-up: "
            + ("n/a" if growth is None else f"{growth:+.1f} MB/h")
            + f" ({f['rss_mb_first']} -> {f['rss_mb_last']} MB)",
            f"event-loop lag p99: max {_ms(f['lag_p99_s_max'])} ms over the samples, "
            f"last {_ms(f['lag_p99_s_last'])} ms; largest lag {_ms(f['lag_max_s'])} ms",
            f"asyncio tasks {f['tasks_first']} -> {f['tasks_last']}; "
            f"open fds {f['fds_first']} -> {f['fds_last']}",
            f"events: {e['stream_events']} in the stream, {e['report_events']} in the report; "
            f"lost {e['lost']}, duplicated {e['duplicated']}; by kind {e['by_kind']}",
            f"jobs: {j['submitted']} submitted, {j['reported']} in the report, states "
            f"{j['states']}; lost {j['lost']}, duplicated {j['duplicated']}",
            f"demo: exit {d['exit_status']}, stopped by {d['stopped_by']} "
            f"({d['stop_lag_s']} s late), report ok {d['report_ok']}",
            f"events lost {doc['lost']}, duplicated {doc['duplicated']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument(
        "--warmup-s", type=float, default=None, help="default: a third of the run, at most 300"
    )
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--job-every-s", type=float, default=40.0, help="mean gap between jobs")
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--racks", type=int, default=4)
    parser.add_argument("--nodes-per-rack", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    args = parser.parse_args(argv)
    minutes = args.minutes
    options = Options(
        minutes=minutes,
        sample_s=args.sample_s,
        warmup_s=min(300.0, minutes * 20.0) if args.warmup_s is None else args.warmup_s,
        seed=random.randrange(2**31) if args.seed is None else args.seed,
        job_every_s=args.job_every_s,
        fleet=Fleet(regions=args.regions, racks=args.racks, nodes_per_rack=args.nodes_per_rack),
        out=args.out,
    )
    with tempfile.TemporaryDirectory(prefix="mg-soak-") as tmp:
        doc = asyncio.run(soak(options, Path(tmp)))
    print(summary(doc), flush=True)
    if options.out is not None:
        options.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"soak: samples written to {options.out}", flush=True)
    ok = doc["lost"] == 0 and doc["duplicated"] == 0
    return 0 if ok and doc["demo"]["exit_status"] == 0 and doc["demo"]["report"] else 1


if __name__ == "__main__":
    sys.exit(main())
