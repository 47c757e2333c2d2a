"""``metalguard twin run|compare``: the fleet twin from the command line (docs/twin.md).

Cheap to import (the composition root registers it with every other command): the
inputs, the engine and matplotlib are imported only when a command runs.

Exit statuses, like the other commands: 0 done; 2 a usage error or bad input (a
:class:`~metalguard.twin.errors.TwinInputError` printed as ``metalguard twin: <file>:
<where>: <problem>``, matplotlib missing for ``--plot``); 1 a report or figure that could
not be written.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from metalguard.twin.model import AllocationMode, JobSpec, Policy, TwinInputs, TwinResult
    from metalguard.twin.sync import PlacementMode

POLICY_CHOICES = ("static", "reactive", "metalguard")
"""The policies by name (:data:`metalguard.twin.model.POLICY_NAMES`, kept here so that
registering the command imports nothing of the twin)."""

PLACEMENT_CHOICES = ("topology", "blind")
"""``--placement`` (:data:`metalguard.twin.sync.PLACEMENT_MODES`, kept here for the same
reason)."""

ALLOCATION_CHOICES = ("dedicated", "pooled")
"""``--allocation`` (:data:`metalguard.twin.model.ALLOCATION_MODES`, kept here for the
same reason)."""

ALLOCATION_POLICY = {"dedicated": "static", "pooled": "metalguard"}
"""The policy each allocation runs under unless ``run --policy`` says otherwise:
dedicated partitions are the seed's "before" (FIFO, no preemption or backfill, nodes
delivered in days), the pool is metalguard's (docs/twin.md "Allocation")."""

PREFIX = "metalguard twin"


class TwinUsageError(Exception):
    """A problem with the command line found after parsing (exit 2)."""


def add_twin_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``metalguard twin run`` and ``metalguard twin compare``."""
    twin = sub.add_parser(
        "twin",
        help="the fleet twin: simulate a fleet for months with the real scheduler, "
        "scoring and lifecycle (docs/twin.md)",
    )
    twin_sub = twin.add_subparsers(dest="twin_command", metavar="ACTION", required=True)
    common = _input_options()
    run = twin_sub.add_parser(
        "run", parents=[common], help="simulate one policy; print its summary, write its report"
    )
    run.add_argument(
        "--policy",
        choices=POLICY_CHOICES,
        default="metalguard",
        action=_Given,
        help="(default: metalguard; with --allocation, static for dedicated and "
        "metalguard for pooled)",
    )
    run.add_argument(
        "--report", metavar="FILE", help="write the report (JSON) here; - prints it instead"
    )
    run.add_argument("--plot", metavar="PNG", help="draw utilisation and running jobs (PNG)")
    run.set_defaults(func=_run)
    compare = twin_sub.add_parser(
        "compare",
        parents=[common],
        help="simulate every policy on the same inputs; print one table, one figure",
    )
    compare.add_argument(
        "--report-dir", metavar="DIR", type=Path, help="write <policy>.json here, one per policy"
    )
    compare.add_argument("--plot", metavar="PNG", help="one figure, a line per policy (PNG)")
    compare.set_defaults(func=_compare)


def _input_options() -> argparse.ArgumentParser:
    """The options ``run`` and ``compare`` share: the fleet, the workload, the faults."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--nodes",
        required=True,
        metavar="FILE|N",
        help="a node count (8 GPUs each, 16 per rack, 32 racks per cluster) or a node list "
        "CSV (the Alibaba schema: sn, cpu_milli, memory_mib, gpu, model)",
    )
    common.add_argument(
        "--trace",
        metavar="FILE",
        help="a job trace CSV (the Alibaba pod list: name, num_gpu, creation_time, "
        "deletion_time, ...); without it only the gang generator's jobs run",
    )
    common.add_argument("--days", type=_positive, default=30.0, help="simulated days (default 30)")
    common.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    common.add_argument(
        "--failures",
        metavar="FILE",
        help="the failure model (TOML; default: Llama 3's cause mix, docs/twin.md)",
    )
    common.add_argument(
        "--failure-rate",
        type=_non_negative,
        metavar="X",
        help="scale the failure model's causes to X unplanned faults per node-day in all",
    )
    common.add_argument(
        "--straggler-rate",
        type=_non_negative,
        metavar="X",
        help="fail-slow nodes: X episodes per node-day (the failure model's [stragglers], "
        "or the default slowdown, duration and repair; default: the model's, none in "
        "the default model)",
    )
    common.add_argument(
        "--no-straggler-detection",
        action="store_true",
        help="turn the metalguard policy's straggler detector off (a fail-slow slows its "
        "jobs until it clears, as under static and reactive)",
    )
    common.add_argument(
        "--straggler-window",
        type=_positive,
        metavar="S",
        help="the detector's timing window in seconds (default 30: a verdict after "
        "1 warm-up + 4 windows, 2.5 min)",
    )
    common.add_argument(
        "--placement",
        choices=PLACEMENT_CHOICES,
        default="topology",
        help="what the scheduler sees of the racks and clusters: topology (default), or "
        "blind (every node in one rack; the sync model still judges the real topology)",
    )
    common.add_argument(
        "--allocation",
        type=_allocations,
        metavar="MODE[,MODE]",
        help="share the fleet among tenants: dedicated (each tenant's contract a fixed "
        "partition, FIFO, under static) or pooled (one pool under tenant quotas, under "
        "metalguard); compare takes dedicated,pooled; default: one pool, no tenants",
    )
    common.add_argument(
        "--tenants",
        metavar="FILE",
        help="the tenants (TOML; needs --allocation; default: the built-in six, docs/twin.md)",
    )
    gangs = common.add_mutually_exclusive_group()
    gangs.add_argument(
        "--gangs", metavar="TOML", help="the gang generator's parameters (default: built in)"
    )
    gangs.add_argument(
        "--no-gangs", action="store_true", help="no generated gang jobs (the trace alone)"
    )
    common.add_argument(
        "--sample",
        type=_positive,
        metavar="S",
        help="seconds between the figure's samples (default: the engine's)",
    )
    return common


class _Given(argparse.Action):
    """Store the value and note that it was given (``<dest>_given``): ``--policy``'s
    default depends on ``--allocation``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _allocations(text: str) -> tuple[str, ...]:
    """``dedicated``, ``pooled`` or both, comma-separated, each once."""
    modes = tuple(m.strip() for m in text.split(","))
    for mode in modes:
        if mode not in ALLOCATION_CHOICES:
            raise argparse.ArgumentTypeError(
                f"{mode!r} is not an allocation (choose from {', '.join(ALLOCATION_CHOICES)})"
            )
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"an allocation is given twice: {text!r}")
    return modes


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def build_inputs(
    nodes: str,
    *,
    days: float,
    seed: int,
    trace: str | None = None,
    failures: str | None = None,
    failure_rate: float | None = None,
    gangs: str | None = None,
    no_gangs: bool = False,
    straggler_rate: float | None = None,
    placement: PlacementMode = "topology",
    allocation: AllocationMode | None = None,
    tenants: str | None = None,
) -> TwinInputs:
    """The run's inputs from the command line's values (the files read and checked; a
    :class:`~metalguard.twin.errors.TwinInputError` for bad input). The gang generator
    draws from ``random.Random(f"{seed}:gangs")``; with an ``allocation`` the tenants'
    jobs replace the gangs (:mod:`metalguard.twin.tenants`), the same for either."""
    from metalguard.twin.failures import (
        default_failure_model,
        load_failure_model,
        with_straggler_rate,
    )
    from metalguard.twin.fleet import fleet_dict, fleet_gpus, load_fleet
    from metalguard.twin.generator import (
        GangParams,
        gang_capacity_gpus,
        generate_gangs,
        load_gang_params,
        params_dict,
    )
    from metalguard.twin.model import TwinInputs
    from metalguard.twin.trace import check_fits, read_trace, trace_dict

    fleet = load_fleet(nodes)
    read = read_trace(trace) if trace else None
    trace_jobs = read.jobs if read is not None else ()
    params = None
    gang_jobs: tuple[JobSpec, ...] = ()
    parts: dict[str, tuple[str, ...]] = {}
    tenant_spec = None
    if allocation is not None:
        from metalguard.twin.tenants import (
            all_tenant_jobs,
            default_tenants,
            load_tenants,
            partition,
        )

        tenant_spec = load_tenants(tenants) if tenants else default_tenants()
        parts = partition(fleet, tenant_spec.tenants)
        gang_jobs = all_tenant_jobs(tenant_spec, fleet, parts, days, seed)
    elif not no_gangs:
        params = load_gang_params(gangs) if gangs else GangParams()
        rng = random.Random(f"{seed}:gangs")
        largest = gang_capacity_gpus(fleet, params.gpus_per_node)
        gang_jobs = generate_gangs(params, fleet_gpus(fleet), days, rng, largest_gang_gpus=largest)
    jobs = (*trace_jobs, *gang_jobs)
    check_fits(jobs, fleet)
    model = (
        load_failure_model(failures, total_rate_per_node_day=failure_rate)
        if failures
        else default_failure_model(failure_rate)
    )
    if straggler_rate is not None:
        model = with_straggler_rate(model, straggler_rate)
    workload: dict[str, Any] = {
        "fleet": fleet_dict(fleet, nodes),
        "trace": trace_dict(read) if read is not None else None,
        "trace_jobs": len(trace_jobs),
        "gangs": gangs if gangs else (None if no_gangs else "built-in"),
        "gang_jobs": len(gang_jobs),
        "gang_generator": params_dict(params) if params is not None else None,
        "gang_seed": f"{seed}:gangs",
        "failure_rate_per_node_day": failure_rate,
        "straggler_rate_per_node_day": straggler_rate,
    }
    if tenant_spec is not None:
        from metalguard.twin.tenants import tenants_dict

        workload |= {
            "gangs": None,
            "gang_seed": None,
            "tenants": tenants_dict(tenant_spec),
            "tenant_seed": f"{seed}:tenants:<name>",
        }
    return TwinInputs(
        nodes=tuple(fleet),
        jobs=jobs,
        failures=model,
        days=days,
        seed=seed,
        workload=workload,
        placement=placement,
        allocation=allocation,
        partitions=parts,
    )


def _inputs(args: argparse.Namespace) -> TwinInputs:
    _check_allocation(args)
    modes = args.allocation or ()
    return build_inputs(
        args.nodes,
        days=args.days,
        seed=args.seed,
        trace=args.trace,
        failures=args.failures,
        failure_rate=args.failure_rate,
        gangs=args.gangs,
        no_gangs=args.no_gangs,
        straggler_rate=args.straggler_rate,
        placement=args.placement,
        allocation=modes[0] if modes else None,
        tenants=args.tenants,
    )


def _check_allocation(args: argparse.Namespace) -> None:
    """``--allocation`` and ``--tenants`` against the other options (exit 2)."""
    modes = args.allocation or ()
    if args.tenants and not modes:
        raise TwinUsageError("--tenants needs --allocation dedicated|pooled")
    if not modes:
        return
    if args.twin_command == "run" and len(modes) > 1:
        raise TwinUsageError(
            f"--allocation {','.join(modes)}: run takes one (compare runs several)"
        )
    for flag, given in (("--trace", args.trace), ("--gangs", args.gangs),
                        ("--no-gangs", args.no_gangs)):  # fmt: skip
        if given:
            raise TwinUsageError(
                f"{flag} with --allocation: the tenants' jobs are the workload (--tenants FILE)"
            )


def _policy(name: str, args: argparse.Namespace) -> Policy:
    """The named policy with the command line's straggler options."""
    from metalguard.twin.policies import POLICIES

    policy = POLICIES[name]  # type: ignore[index]
    if args.no_straggler_detection:
        policy = dataclasses.replace(policy, straggler_detection=False)
    if args.straggler_window is not None:
        policy = dataclasses.replace(policy, straggler_window_s=args.straggler_window)
    return policy


def _simulate(inputs: TwinInputs, policy: Policy, sample_s: float | None) -> TwinResult:
    """One run, its duration on stderr."""
    from metalguard.twin.engine import run

    started = time.perf_counter()
    result = run(inputs, policy, sample_s=sample_s)
    slow = f", {len(result.stragglers):,} stragglers" if result.stragglers else ""
    print(
        f"{PREFIX}: {policy.name}: {len(inputs.nodes):,} nodes, {len(inputs.jobs):,} jobs, "
        f"{len(result.faults):,} faults{slow}, {inputs.days:g} days: {result.events:,} "
        f"events in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def _run(args: argparse.Namespace) -> int:
    """``twin run``: one policy."""
    return _guarded(_run_one, args)


def _compare(args: argparse.Namespace) -> int:
    """``twin compare``: every policy on the same inputs."""
    return _guarded(_run_all, args)


def _run_one(args: argparse.Namespace) -> int:
    from metalguard.twin.report import build_report, compare_table, dump_report, dumps_report

    _check_outputs(args.plot, args.report if args.report != "-" else None, None)
    inputs = _inputs(args)
    name = args.policy
    if inputs.allocation is not None and not getattr(args, "policy_given", False):
        name = ALLOCATION_POLICY[inputs.allocation]
    result = _simulate(inputs, _policy(name, args), args.sample)
    report = build_report(result)
    if args.report == "-":
        sys.stdout.write(dumps_report(report))
    else:
        print(compare_table([report]))
    try:
        if args.report and args.report != "-":
            dump_report(report, args.report)
        if args.plot:
            _draw([result], args.plot)
    except OSError as exc:
        return _fail(f"cannot write {exc.filename or ''}: {exc.strerror or exc}", 1)
    return 0


def _run_all(args: argparse.Namespace) -> int:
    from metalguard.twin.model import POLICY_NAMES
    from metalguard.twin.report import build_report, compare_table, dump_report

    _check_outputs(args.plot, None, args.report_dir)
    inputs = _inputs(args)
    if inputs.allocation is not None:  # one run per allocation, the same jobs
        runs = [
            (dataclasses.replace(inputs, allocation=mode), ALLOCATION_POLICY[mode])
            for mode in args.allocation
        ]
    else:
        runs = [(inputs, name) for name in POLICY_NAMES]
    results = [_simulate(i, _policy(name, args), args.sample) for i, name in runs]
    reports = [build_report(result) for result in results]
    print(compare_table(reports))
    try:
        if args.report_dir is not None:
            for report in reports:
                name = report["allocation"] or report["policy"]
                dump_report(report, args.report_dir / f"{name}.json")
        if args.plot:
            _draw(results, args.plot)
    except OSError as exc:
        return _fail(f"cannot write {exc.filename or ''}: {exc.strerror or exc}", 1)
    return 0


def _check_outputs(plot: str | None, report: str | None, report_dir: Path | None) -> None:
    """Before the (maybe long) run: the figure can be drawn, the files can be written."""
    if plot:
        from metalguard.twin.plot import require_matplotlib

        require_matplotlib()
    for name, path in (("--plot", plot), ("--report", report)):
        if path and not Path(path).resolve().parent.is_dir():
            raise TwinUsageError(f"{name} {path}: no such directory")
    if report_dir is not None:
        try:
            report_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TwinUsageError(f"--report-dir {report_dir}: {exc.strerror or exc}") from None


def _draw(results: Sequence[TwinResult], path: str) -> None:
    from metalguard.twin.plot import plot

    plot(results, path)


def _guarded(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``fn(args)`` with bad input (exit 2) printed as ``metalguard twin: <problem>``."""
    from metalguard.twin.errors import TwinInputError
    from metalguard.twin.plot import PlotUnavailableError

    try:
        code: int = fn(args)
    except (TwinInputError, TwinUsageError, PlotUnavailableError) as exc:
        return _fail(str(exc), 2)
    except OSError as exc:  # an input file that could not be read
        return _fail(f"{exc.filename or ''}: {exc.strerror or exc}", 2)
    return code


def _fail(message: str, code: int) -> int:
    print(f"{PREFIX}: {message}", file=sys.stderr)
    return code
