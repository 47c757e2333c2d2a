"""The tests' helpers, apart from the tests (tests/unit and tests/integration hold only
test_*.py, conftest.py and __init__.py; tests/unit/test_test_layout.py checks it):

- tests/support/*.py: pure helpers any test may import (a manual clock, polling waits,
  sample trees and documents, fakes, scoring cases): no process, socket, root or server,
  through their own imports either (test_test_layout.py follows them);
- tests/support/harness/: what the integration tests (and bench/) run against: child
  processes, emulators, VMs, clusters and the controllers' environments over a real
  nats-server, with their non-Python parts (rxe_init.sh, provision_guest/).

Fixtures stay in the directories' conftest.py files (the nats-server ones in
tests/integration/conftest.py); helper modules define none."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""

FIXTURES = ROOT / "tests" / "fixtures"
"""Recorded inputs and expected outputs (sysfs trees, tool output, documents)."""
