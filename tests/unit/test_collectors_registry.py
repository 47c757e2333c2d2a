"""The collector package: lazy to import, and load_builtin registers the sysfs collectors."""

from __future__ import annotations

import subprocess
import sys

from metalguard.agent.collectors import load_builtin
from metalguard.agent.collectors.base import REGISTRY, CollectorSettings


def test_package_import_is_light() -> None:
    code = (
        "import sys, agent.collectors\n"
        "bad = [m for m in sys.modules if m.startswith('agent.collectors.') and m != "
        "'metalguard.agent.collectors.base'] + [m for m in ('nats', 'aiohttp', 'pysnmp', 'pyudev', "
        "'pyroute2') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_load_builtin_registers_sysfs_collectors() -> None:
    load_builtin()
    load_builtin()  # idempotent: modules are imported once
    for name in ("edac", "pcie", "hwmon"):
        registration = REGISTRY[name]
        assert registration.default_interval_s == 5
        assert registration.enabled_by_default
        collector = registration.factory(CollectorSettings())
        assert collector.name == name
        assert collector.field == name
