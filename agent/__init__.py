"""The metalguard node agent: collectors, publisher, service."""
