"""The Redfish emulator itself (tests/support/harness/redfish_emulator.py): credentials,
sessions and a reset, seen through plain HTTP."""

from __future__ import annotations

import base64
import ssl

import aiohttp

from tests.support.harness.redfish_emulator import PASSWORD, SYSTEM, USER, RunningEmulator


async def test_emulator_requires_credentials_and_resets(bmc: RunningEmulator) -> None:
    ctx = ssl.create_default_context(cafile=str(bmc.certificate.cert))
    base = f"https://{bmc.address}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
        async with http.get(f"{base}/redfish/v1/") as resp:
            assert resp.status == 200  # the service root is open
        async with http.get(f"{base}{SYSTEM}") as resp:
            assert resp.status == 401
        auth = {
            "Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        }
        reset = f"{base}{SYSTEM}/Actions/ComputerSystem.Reset"
        async with http.post(reset, json={"ResetType": "PowerCycle"}, headers=auth) as resp:
            assert resp.status == 400  # not allowed by this mockup
        async with http.post(reset, json={"ResetType": "ForceOff"}, headers=auth) as resp:
            assert resp.status == 204
        async with http.get(f"{base}{SYSTEM}", headers=auth) as resp:
            assert (await resp.json())["PowerState"] == "Off"
    assert bmc.emulator.resets == ["ForceOff"]
