"""tests/unit holds only tests that need no root, no subprocess and no server (their
imports, followed through the tests.support modules they use, are checked by
test_test_layout.py). The nats-server fixtures live in tests/integration/conftest.py, out
of reach: a unit test that asks for ``nats_server``, ``nc``, ``subjects``, ... fails with
pytest's "fixture not found". The unit tests share no fixture; their shared helpers are in
tests/support (scoring_helpers.py, ...)."""
