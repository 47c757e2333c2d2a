"""The agent's side against the Redfish emulator: a credentials file, a target naming the
emulator, and a remediator that trusts its certificate
(tests/support/harness/redfish_emulator.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path

from metalguard.agent.bmc.commands import BmcCommandService
from metalguard.agent.bmc.remediation import Remediator, open_control
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.agent.connection import NatsSettings
from metalguard.proto.subjects import Subjects
from tests.support.harness.redfish_emulator import PASSWORD, USER, RunningEmulator
from tests.support.waiting import wait_until


def credentials(tmp_path: Path, user: str = USER, password: str = PASSWORD) -> str:
    """A ``[[bmc]]`` credentials file (mode 0600) under ``tmp_path``; its path."""
    path = tmp_path / "bmc-creds.toml"
    path.write_text(f'user = "{user}"\npassword = "{password}"\n')
    path.chmod(0o600)
    return str(path)


def target(address: str, creds: str, **kw: object) -> BmcTarget:
    """A Redfish target of node eu1.trainA.gpu017 at ``address`` (short timeout, no retry)."""
    fields: dict[str, object] = {
        "node": "eu1.trainA.gpu017",
        "address": address,
        "protocol": "redfish",
        "credentials": creds,
        "timeout_s": 2.0,
        "retries": 0,
    }
    fields.update(kw)
    return BmcTarget(**fields)  # type: ignore[arg-type]


def bmc_target(run: RunningEmulator, tmp_path: Path, **kw: object) -> BmcTarget:
    """The target of a running emulator, with the right credentials."""
    return target(run.address, credentials(tmp_path), **kw)


def remediator(run: RunningEmulator, **kw: object) -> Remediator:
    """A remediator that trusts the emulator's certificate and polls quickly."""
    opener = functools.partial(open_control, cafile=str(run.certificate.cert))
    settings: dict[str, object] = {"poll_s": 0.01, "transition_timeout_s": 5.0, **kw}
    return Remediator(opener=opener, **settings)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def command_service(
    run: RunningEmulator, tmp_path: Path, nats_url: str, subjects: Subjects
) -> AsyncIterator[BmcCommandService]:
    """A bmc-proxy's command service for the emulator's node, subscribed and running."""
    svc = BmcCommandService(
        [bmc_target(run, tmp_path)],
        remediator(run, store=tmp_path / "outcomes.jsonl"),
        NatsSettings(servers=(nats_url,)),
        subjects,
    )
    async with serving(svc) as running:
        yield running


@contextlib.asynccontextmanager
async def serving(svc: BmcCommandService) -> AsyncIterator[BmcCommandService]:
    """``svc`` started, running and subscribed; closed on the way out."""
    await svc.start()
    task = asyncio.create_task(svc.run())
    await wait_until(lambda: svc.subscribed, 10, "the command subscriptions")
    try:
        yield svc
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await svc.close()
