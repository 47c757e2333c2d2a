"""The lease's pure decisions (controller/leader.py)."""

from __future__ import annotations

import pytest

from metalguard.controller.leader import LeaderStatus, LeaseTiming, expires_in, holding, lease_key

TIMING = LeaseTiming(ttl_s=10.0, renew_s=3.0, poll_s=0.5, margin_s=1.0)


def test_a_holder_leads_until_ttl_minus_margin_after_its_last_renewal() -> None:
    assert holding(100.0, 100.0, TIMING)
    assert holding(100.0, 108.9, TIMING)
    assert not holding(100.0, 109.0, TIMING)
    assert not holding(None, 100.0, TIMING)


def test_expiry_counts_down_from_the_last_write_and_stops_at_zero() -> None:
    assert expires_in(100.0, 103.0, 10.0) == 7.0
    assert expires_in(100.0, 111.0, 10.0) == 0.0


@pytest.mark.parametrize(
    ("ttl", "renew", "margin"), [(10.0, 9.5, 1.0), (3.0, 0.0, 0.5), (2.0, 2.0, 0.0)]
)
def test_a_renewal_that_cannot_beat_the_ttl_is_refused(
    ttl: float, renew: float, margin: float
) -> None:
    with pytest.raises(ValueError, match="renew_s"):
        LeaseTiming(ttl_s=ttl, renew_s=renew, margin_s=margin)


def test_status_body_names_region_leader_self_term_and_expiry() -> None:
    status = LeaderStatus("r1", "ctl-b", "ctl-a", 7, 9, 4.56789, False)
    assert status.as_dict() == {
        "region": "r1",
        "leader": "ctl-a",
        "self": "ctl-b",
        "leading": False,
        "term": 7,
        "revision": 9,
        "expires_in_s": 4.568,
    }
    assert lease_key("eu-west") == "leader.eu-west"
