"""What every test needs, and nothing more: today, nothing. The house (README.md):

- tests/unit: tests that need no root, no subprocess and no server;
- tests/integration: tests against a real nats-server and real processes; the server's
  fixtures (``nats_server``, ``nc``, ``subjects``, ...) are in tests/integration/conftest.py;
- tests/support: the helpers both import (tests/support/harness: the integration ones);
- tests/fixtures: recorded inputs and expected outputs (``tests.support.FIXTURES``).

This module imports no server code: tests/unit must not reach it, even through here."""
