"""tests/unit holds only tests that need no root, no subprocess and no server (its modules'
imports are checked by test_test_layout.py). The session nats-server of tests/conftest.py
is not theirs: these overrides fail a unit test that asks for it (through ``nats_url``,
``nc`` or ``subjects`` too), naming where the test belongs. The unit tests share no
fixture; their shared helpers are the modules beside them (scoring_helpers.py, ...)."""

from __future__ import annotations

from typing import NoReturn

import pytest

WHY = "a unit test needs no server: this one belongs in tests/integration"


@pytest.fixture(scope="session")
def nats_server() -> NoReturn:
    """Not for unit tests."""
    pytest.fail(f"nats_server: {WHY}", pytrace=False)


@pytest.fixture
def fresh_server() -> NoReturn:
    """Not for unit tests."""
    pytest.fail(f"fresh_server: {WHY}", pytrace=False)
