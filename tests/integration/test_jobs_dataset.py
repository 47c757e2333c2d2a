"""A job naming a dataset, through the real region controller and job manager over the
session nats-server: the nodes' batches say where the dataset is warm (their ``cache``
list), the queue pass places the job there among equal racks, and its start commands
carry the dataset (the runner's MG_DATASET / MG_DATASET_DIR: test_workload_runner.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.store import JobStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import Command, CommandReply, CommandStatus
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import DatasetCache, TelemetryBatch
from metalguard.proto.topology import NodeTopology
from tests.support.clock import T0
from tests.support.harness.api_env import ApiEnv, api_env
from tests.support.scoring_helpers import dimm_mc
from tests.support.waiting import wait_until

RACKS = ("a", "b", "c")
WARM_RACK = "b"


def _batch(rack: str, n: int) -> TelemetryBatch:
    """Node ``<rack><n>`` of rack ``rack`` (8 GPUs); rack b's nodes have imagenet warm."""
    caches: tuple[DatasetCache, ...] = ()
    if rack == WARM_RACK:
        caches = (DatasetCache(dataset="imagenet", ts=T0, max_bytes=100, used_bytes=90),)
    return TelemetryBatch(
        node=NodeIdentity(region="r1", cluster="c1", node=f"{rack}{n}"),
        seq=1,
        ts=T0 + 1,
        interval_s=5.0,
        edac=(dimm_mc(),),
        topology=NodeTopology(rack=rack, gpus=8, cpu_cores=32, memory_gb=256),
        cache=caches,
    )


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[ApiEnv]:
    async with api_env(nc, subjects) as e:
        await e.feed(*(_batch(rack, n) for rack in RACKS for n in (1, 2)))
        yield e


async def test_the_job_goes_where_its_dataset_is_warm_and_its_members_are_told(
    env: ApiEnv, nc: Client, subjects: Subjects
) -> None:
    starts: list[Command] = []

    async def answer(msg: Msg) -> None:
        cmd = decode(msg.data, Command)
        starts.append(cmd)
        reply = CommandReply(
            command_id=cmd.command_id, ts=T0, ok=True, status=CommandStatus.DONE, node=cmd.node
        )
        await msg.respond(encode(reply))

    sub = await nc.subscribe(f"{subjects.prefix}.cmd.r1.c1.*.start", cb=answer)
    js = nc.jetstream(timeout=5)
    manager = JobManager(
        nc, js, await JobStore.open(js, subjects), env.controller.store, subjects, "r1",
        fleet=env.controller.topology.fleet, clock=env.clock,
    )  # fmt: skip
    try:
        assert env.controller.warm_datasets("r1.c1.b1") == {"imagenet"}
        job = {"nodes": 2, "command": "python", "gpus_per_node": 8, "max_spread": "rack"}
        await manager.submit({"job_id": "j1", "name": "warm", "dataset": "imagenet", **job})
        await manager.submit({"job_id": "j2", "name": "plain", **job})
        await manager.run_pass()
        # three equal racks: the dataset's job where it is warm, the other one by name
        assert manager.jobs["j1"].placement == ("r1.c1.b1", "r1.c1.b2")
        assert manager.jobs["j2"].placement == ("r1.c1.a1", "r1.c1.a2")
        await wait_until(lambda: len(starts) == 4, 10, "the four start commands")
        by_job = {(c.args["job_id"], c.node.node): c.args for c in starts}
        assert by_job["j1", "b1"]["dataset"] == "imagenet"
        assert by_job["j1", "b2"]["dataset"] == "imagenet"
        assert "dataset" not in by_job["j2", "a1"]
    finally:
        await manager.stop()
        await sub.unsubscribe()
