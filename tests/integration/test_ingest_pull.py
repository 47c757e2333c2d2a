"""controller.ingest_pull.Puller against the session nats-server: batches up to the size
asked, an empty pull ends at the server's 408, a deleted consumer is reported, and the
messages ack like any others."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import ServiceUnavailableError

from metalguard.controller.ingest.pull import ConsumerGoneError, Puller
from metalguard.proto.subjects import Subjects

DURABLE = "puller-test"


async def setup(nc: Client, subjects: Subjects, n: int) -> Puller:
    js = nc.jetstream(timeout=5)
    for i in range(n):
        await js.publish(subjects.telemetry("r1", "c1", f"n{i}"), b"x")
    config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT)
    await js.add_consumer(subjects.stream_telemetry, config)
    puller = Puller(nc, subjects.stream_telemetry, DURABLE)
    await puller.start()
    return puller


async def test_batches_come_in_order_up_to_the_size_asked(nc: Client, subjects: Subjects) -> None:
    puller = await setup(nc, subjects, 25)
    try:
        first = await puller.fetch(10, 2.0)
        second = await puller.fetch(100, 2.0)  # 15 left: the server's 408 ends the pull
        assert [m.metadata.sequence.stream for m in first] == list(range(1, 11))
        assert [m.metadata.sequence.stream for m in second] == list(range(11, 26))
        for m in first + second:
            await m.ack()
        js = nc.jetstream(timeout=5)

        async def acked() -> bool:
            info = await js.consumer_info(subjects.stream_telemetry, DURABLE)
            return (info.num_ack_pending, info.num_pending) == (0, 0)

        deadline = time.monotonic() + 5
        while not await acked():
            assert time.monotonic() < deadline, "acks not taken"
            await nc.flush()
    finally:
        await puller.unsubscribe()


async def test_an_empty_pull_times_out_after_its_expiry(nc: Client, subjects: Subjects) -> None:
    puller = await setup(nc, subjects, 0)
    try:
        started = time.monotonic()
        with pytest.raises(nats.errors.TimeoutError):
            await puller.fetch(10, 0.3)
        assert 0.25 <= time.monotonic() - started < 1.0  # the server's 408, not our margin
    finally:
        await puller.unsubscribe()


async def test_a_deleted_consumer_is_reported(nc: Client, subjects: Subjects) -> None:
    puller = await setup(nc, subjects, 0)
    js = nc.jetstream(timeout=5)
    try:
        await js.delete_consumer(subjects.stream_telemetry, DURABLE)
        with pytest.raises(nats.errors.Error) as caught:
            await puller.fetch(10, 0.5)
        # no responders (503) or the 409 of a consumer deleted under a waiting pull
        assert isinstance(caught.value, ServiceUnavailableError | ConsumerGoneError)
    finally:
        await puller.unsubscribe()


async def test_fetch_needs_a_subscription(nc: Client, subjects: Subjects) -> None:
    puller = Puller.over(nc.jetstream(), subjects.stream_telemetry, DURABLE)
    with pytest.raises(nats.errors.BadSubscriptionError):
        await puller.fetch(1, 0.1)


async def test_a_consumer_deleted_under_a_waiting_pull_is_gone(
    nc: Client, subjects: Subjects
) -> None:
    puller = await setup(nc, subjects, 0)
    js = nc.jetstream(timeout=5)
    try:
        waiting = asyncio.create_task(puller.fetch(10, 5.0))
        deadline = time.monotonic() + 5
        while (await js.consumer_info(subjects.stream_telemetry, DURABLE)).num_waiting != 1:
            assert time.monotonic() < deadline, "the waiting pull never reached the server"
        await js.delete_consumer(subjects.stream_telemetry, DURABLE)
        with pytest.raises(ConsumerGoneError):
            await asyncio.wait_for(waiting, 5.0)
    finally:
        await puller.unsubscribe()


async def test_a_waiting_pull_returns_with_the_first_messages(
    nc: Client, subjects: Subjects
) -> None:
    puller = await setup(nc, subjects, 0)
    js = nc.jetstream(timeout=5)
    try:
        waiting = asyncio.create_task(puller.fetch(256, 5.0))
        deadline = time.monotonic() + 5
        while (await js.consumer_info(subjects.stream_telemetry, DURABLE)).num_waiting != 1:
            assert time.monotonic() < deadline, "the waiting pull never reached the server"
        started = time.monotonic()
        for i in range(3):
            await js.publish(subjects.telemetry("r1", "c1", f"n{i}"), b"x")
        got = await asyncio.wait_for(waiting, 5.0)
        assert time.monotonic() - started < 1.0  # not when 256 came, nor at the expiry
        assert 1 <= len(got) <= 3
        while len(got) < 3:  # the rest, however the server and the socket split them
            got += await puller.fetch(256, 1.0)
        assert [m.metadata.sequence.stream for m in got] == [1, 2, 3]
    finally:
        await puller.unsubscribe()
