"""The integration tests' harnesses (see tests/support/__init__.py); not for tests/unit."""
