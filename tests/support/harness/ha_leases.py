"""The leadership timings of the HA tests (a lease of TTL_S, renewed every RENEW_S) and the
leases bucket made again with that TTL: what the ``short_leases`` fixture
(tests/integration/conftest.py) does to the test's private streams."""

from __future__ import annotations

from nats.js import JetStreamContext

from metalguard.controller.state.streams import StreamSettings, bucket_configs
from metalguard.proto.subjects import Subjects

TTL_S = 2.0
RENEW_S = 0.5
POLL_S = 0.2
MARGIN_S = 0.5


async def shorten_leases(js: JetStreamContext, subjects: Subjects) -> None:
    """Replace the leases bucket of ``subjects`` with one whose TTL is TTL_S."""
    (leases,) = [
        b
        for b in bucket_configs(subjects, StreamSettings(lease_ttl_s=TTL_S))
        if b.bucket == subjects.bucket("leases")
    ]
    await js.delete_key_value(leases.bucket)
    await js.create_key_value(leases)
