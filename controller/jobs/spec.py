"""Turning a submitted job (JSON, TOML or CLI flags) into a valid :class:`proto.jobs.Job`.

Pure: :func:`parse_job` decodes plain data and collects every problem it can find, so an
invalid job is rejected with all its reasons at once (docs/jobs.md).
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Final

import msgspec

from metalguard.proto.base import DATASET_NAME_PATTERN
from metalguard.proto.documents import DocumentError, describe_validation_error, parse_toml
from metalguard.proto.jobs import Job

JOB_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
ENV_NAME_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
DATASET_RE: Final = re.compile(DATASET_NAME_PATTERN)
"""A job's non-empty ``dataset``: a ``[[cache.datasets]]`` name (proto.base.DatasetName)."""
DATASET_PATTERN: Final = r"^$|^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""The same as a JSON Schema pattern (the OpenAPI document's JobRequest)."""
RESERVED_ENV: Final = frozenset(
    {
        "MG_JOB_ID",
        "MG_TIMING_WINDOW_S",
        "MG_RANK",
        "MG_WORLD_SIZE",
        "MG_MASTER_ADDR",
        "MG_MASTER_PORT",
        "MG_CHECKPOINT_DIR",
        "MG_RESUME_FROM",
        "MG_DATASET",
        "MG_DATASET_DIR",
    }
)
MAX_NODES: Final = 100_000
SET_BY_CONTROLLER: Final = ("submitted_ts", "v", "type")


class NotLeaderError(Exception):
    """Jobs are submitted and cancelled through the region's leading controller."""


class JobRejectedError(ValueError):
    """The job is invalid; ``reasons`` lists every problem found."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class JobFileError(DocumentError):
    """A job file is not a valid job; ``reasons`` lists every problem, and the message
    names the file before each (``job.toml: nodes: Expected `int`, got `str```)."""

    def __init__(self, source: str, reasons: list[str]) -> None:
        super().__init__("; ".join(f"{source}: {reason}" for reason in reasons))
        self.source = source
        self.reasons = reasons


def job_document(text: str, source: str) -> dict[str, Any]:
    """A job file's text as plain data: JSON when ``source`` ends in ``.json``, else TOML.

    JobFileError naming ``source`` when it is neither, or not a table of keys.
    """
    if source.endswith(".json"):
        try:
            loaded = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise JobFileError(source, [f"not valid JSON: {exc}"]) from None
        except RecursionError:
            raise JobFileError(source, ["not valid JSON: nested too deeply"]) from None
        if not isinstance(loaded, dict):
            raise JobFileError(source, ["expected a JSON object (a table of keys)"])
        return loaded
    try:
        return parse_toml(text, source)
    except DocumentError as exc:
        raise JobFileError(source, [str(exc).removeprefix(f"{source}: ")]) from None


def parse_job_file(text: str, source: str, now: float) -> Job:
    """A job file's text validated into a Job (:func:`job_document`, :func:`parse_job`);
    JobFileError naming ``source``, every key and its problem."""
    try:
        return parse_job(job_document(text, source), now)
    except JobRejectedError as exc:
        raise JobFileError(source, exc.reasons) from None


def new_job_id() -> str:
    """A fresh job id, ``j-`` and 12 hex digits (a valid KV key and subject token)."""
    return f"j-{uuid.uuid4().hex[:12]}"


def parse_job(raw: Any, now: float, job_id: str | None = None) -> Job:
    """Validate a submitted job (plain data) into a Job stamped ``submitted_ts = now``.

    The id is ``raw["job_id"]`` when given, else ``job_id``, else a new one.
    JobRejectedError with every reason found (unknown keys, types, ranges, semantics).
    """
    if not isinstance(raw, dict):
        raise JobRejectedError(["the job must be an object (a table of keys)"])
    data = {k: v for k, v in raw.items() if k not in SET_BY_CONTROLLER}
    reasons: list[str] = []
    unknown = sorted(set(data) - set(Job.__struct_fields__))
    reasons += [f"{key}: unknown key" for key in unknown]
    for key in unknown:
        del data[key]
    data.setdefault("job_id", job_id or new_job_id())
    data["submitted_ts"] = now
    # Decode key by key so one bad value does not hide the others.
    for key, value in list(data.items()):
        probe = {"job_id": "probe", "name": "probe", key: value}
        try:
            msgspec.convert(probe, Job)
        except msgspec.ValidationError as exc:
            reasons.append(describe_validation_error(str(exc)))
            del data[key]
    if "nodes" not in data and isinstance(data.get("min_nodes"), int):
        data["nodes"] = data["min_nodes"]  # an elastic job asks for its least first
    if "name" not in data and not any(r.startswith("name:") for r in reasons):
        reasons.append("name: missing (required)")
    if reasons:
        raise JobRejectedError(reasons)
    job = msgspec.convert(data, Job)
    problems = job_problems(job)
    if problems:
        raise JobRejectedError(problems)
    return job


def job_problems(job: Job) -> list[str]:
    """What is semantically wrong with a decoded job (empty: it may be queued)."""
    reasons: list[str] = []
    if not JOB_ID_RE.match(job.job_id):
        reasons.append("job_id: letters, digits, '-' and '_' only, 1 to 64 characters")
    if not job.name.strip():
        reasons.append("name: must not be empty")
    if not job.tenant.strip() or any(c in job.tenant for c in ". *>"):
        reasons.append("tenant: must be a non-empty name without '.', '*', '>' or spaces")
    if job.nodes > MAX_NODES:
        reasons.append(f"nodes: at most {MAX_NODES}")
    reasons += node_range_problems(job)
    if not job.command.strip():
        reasons.append("command: must not be empty (the program each member runs)")
    if job.gpu_type and job.gpus_per_node == 0:
        reasons.append("gpu_type: set, but gpus_per_node is 0")
    if job.checkpoint_every < 0:
        reasons.append("checkpoint_every: must be >= 0 seconds")
    if not job.timing_window_s > 0:
        reasons.append("timing_window_s: must be > 0 seconds")
    if job.restart_cost_s is not None and job.restart_cost_s < 0:
        reasons.append("restart_cost_s: must be >= 0 seconds")
    if job.hang_timeout is not None and job.hang_timeout < 0:
        reasons.append("hang_timeout: must be >= 0 seconds (0: no hang detection)")
    if job.max_latency_ms is not None and job.max_latency_ms <= 0:
        reasons.append("max_latency_ms: must be > 0")
    for name in job.env:
        if not ENV_NAME_RE.match(name):
            reasons.append(f"env.{name}: not a valid environment variable name")
        elif name in RESERVED_ENV:
            reasons.append(f"env.{name}: set by the runner; do not set it")
    if job.dataset and not DATASET_RE.match(job.dataset):
        reasons.append(
            "dataset: a dataset name (letters, digits, '_', '.', '-'; 1 to 64 characters, "
            "starting with a letter or digit), or empty"
        )
    for region in job.allowed_regions:
        if not region or any(c in region for c in ". *>"):
            reasons.append(f"allowed_regions: {region!r} is not a region name")
    return reasons


def node_range_problems(job: Job) -> list[str]:
    """What is wrong with an elastic job's sizes (docs/jobs.md "Elastic jobs"): each
    bound at most ``MAX_NODES``, ``min_nodes <= max_nodes``, ``nodes`` within both, and a
    resize interval of at least 0 seconds."""
    reasons = [
        f"{key}: at most {MAX_NODES}"
        for key, value in (("min_nodes", job.min_nodes), ("max_nodes", job.max_nodes))
        if value is not None and value > MAX_NODES
    ]
    low, high = job.min_nodes, job.max_nodes
    if low is not None and high is not None and low > high:
        reasons.append(f"min_nodes: must be <= max_nodes ({low} > {high})")
    else:
        if low is not None and job.nodes < low:
            reasons.append(f"nodes: must be >= min_nodes ({job.nodes} < {low})")
        if high is not None and job.nodes > high:
            reasons.append(f"nodes: must be <= max_nodes ({job.nodes} > {high})")
    if not job.resize_interval_s >= 0:
        reasons.append("resize_interval_s: must be >= 0 seconds")
    return reasons
