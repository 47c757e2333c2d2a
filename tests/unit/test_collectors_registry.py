"""The collector package: load_builtin registers the sysfs collectors (that the package is
lazy to import: tests/integration/test_collectors_import.py)."""

from __future__ import annotations

from metalguard.agent.collectors import load_builtin
from metalguard.agent.collectors.base import REGISTRY, CollectorSettings


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
