"""Fixtures that several integration test files share: the session nats-server and each
test's private streams (``nats_server``, ``nats_url``, ``nc``, ``subjects``,
``fresh_server``), and the harnesses behind the others, which live in tests/support/harness
(not here, not in test_*.py). tests/unit sees none of these: a unit test asking for one
fails with pytest's "fixture not found"."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from metalguard.controller.broker.server import NatsServer
from metalguard.proto.subjects import Subjects
from tests.support.harness.ha_leases import shorten_leases
from tests.support.harness.private_streams import drop_streams, private_subjects
from tests.support.harness.provision_env import ProvisionEnv, missing_tools, provision_env
from tests.support.harness.qos_netns import VethPair, veth_pair
from tests.support.harness.redfish_emulator import (
    Certificate,
    RedfishEmulator,
    RunningEmulator,
    make_certificate,
    start_emulator,
)
from tests.support.harness.slurm_cluster import SlurmCluster, missing_reason


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used the session nats-server gets its last log lines in the report:
    the server tells a client some failures only as a fixed sentence ("error creating store
    for stream") and writes the cause to its own log."""
    report = yield
    server = getattr(item, "funcargs", {}).get("nats_server")
    if report.failed and isinstance(server, NatsServer):
        report.sections.append(("nats-server log", "\n".join(server.log_tail())))
    return report


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """One real nats-server for the whole session, on a free loopback port."""
    server = NatsServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """The session server's client URL."""
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A connected client, drained at the end of the test."""
    client = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A private server for tests that stop and restart it (same port, same store)."""
    server = NatsServer(store_dir=tmp_path / "js")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def subjects(nc: Client) -> AsyncIterator[Subjects]:
    """The design's streams and buckets under a prefix of this test's own (tests share the
    session server), deleted afterwards."""
    js = nc.jetstream(timeout=5)
    private = await private_subjects(js)
    try:
        yield private
    finally:
        await drop_streams(js, private)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    """A self-signed certificate for 127.0.0.1, one per test module."""
    return make_certificate(tmp_path_factory.mktemp("bmc-tls"))


@pytest.fixture
async def bmc(certificate: Certificate) -> AsyncIterator[RunningEmulator]:
    """A fresh Redfish emulator (ThermalSubsystem/PowerSubsystem + legacy) on a loopback
    port, over HTTPS with ``certificate``."""
    emulator = RedfishEmulator()
    runner, address = await start_emulator(emulator, certificate)
    try:
        yield RunningEmulator(emulator, address, certificate)
    finally:
        await runner.cleanup()


@pytest.fixture
def pair() -> Iterator[VethPair]:
    """Two fresh network namespaces joined by a veth pair, removed afterwards (root only:
    mark the test with ``qos_netns.needs_root``)."""
    with veth_pair() as p:
        yield p


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    """A running one-node Slurm, stopped at the end even when the test fails; skipped with
    the reason printed where Slurm or root is missing."""
    reason = missing_reason()
    if reason is not None:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    # Not under tmp_path: slurmstepd's step sockets live in the spool dir, and pytest's
    # per-worker temp paths (.../popen-gw3/test_.../) push them past the 108-byte limit.
    root = Path(tempfile.mkdtemp(prefix="mg-slurm-", dir="/tmp"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def short_leases(nc: Client, subjects: Subjects) -> Subjects:
    """The test's private ``subjects``, its leases bucket made again with a TTL of
    ``ha_leases.TTL_S``."""
    await shorten_leases(nc.jetstream(timeout=5), subjects)
    return subjects


@pytest.fixture
async def provision(
    nc: Client, nats_url: str, subjects: Subjects, certificate: Certificate, tmp_path: Path
) -> AsyncIterator[ProvisionEnv]:
    """A region for the provisioning service with real parts and no VM
    (tests/support/harness/provision_env.py); skipped with the reason printed where the
    storage tools are missing."""
    missing = missing_tools()
    if missing:
        reason = f"not installed: {', '.join(missing)} (tests/ensure-tools.sh)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    async with provision_env(nc, nats_url, subjects, certificate, tmp_path) as env:
        yield env
