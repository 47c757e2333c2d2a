"""The agent's side against the Redfish emulator: a credentials file, a target naming the
emulator, and a remediator that trusts its certificate (tests/integration/redfish_emulator.py)."""

from __future__ import annotations

import functools
from pathlib import Path

from metalguard.agent.bmc.remediation import Remediator, open_control
from metalguard.agent.bmc.targets import BmcTarget
from tests.integration.redfish_emulator import PASSWORD, USER, RunningEmulator


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
