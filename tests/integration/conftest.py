"""Fixtures that several integration test files share. The session nats-server and its
private streams (``nats_server``, ``nc``, ``subjects``, ...) are in tests/conftest.py; the
helpers behind these fixtures live in this directory's helper modules (not test_*.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.proto.subjects import Subjects
from tests.integration.ha_leases import shorten_leases
from tests.integration.provision_env import ProvisionEnv, missing_tools, provision_env
from tests.integration.qos_netns import VethPair, veth_pair
from tests.integration.redfish_emulator import (
    Certificate,
    RedfishEmulator,
    RunningEmulator,
    make_certificate,
    start_emulator,
)
from tests.integration.slurm_cluster import SlurmCluster, missing_reason


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
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    """A running one-node Slurm, stopped at the end even when the test fails; skipped with
    the reason printed where Slurm or root is missing."""
    reason = missing_reason()
    if reason is not None:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path / "slurm")
    cluster.root.mkdir(mode=0o700)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


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
    (tests/integration/provision_env.py); skipped with the reason printed where the
    storage tools are missing."""
    missing = missing_tools()
    if missing:
        reason = f"not installed: {', '.join(missing)} (tests/ensure-tools.sh)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    async with provision_env(nc, nats_url, subjects, certificate, tmp_path) as env:
        yield env
