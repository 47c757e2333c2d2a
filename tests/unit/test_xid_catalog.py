"""NVIDIA's XID catalog as shipped (proto/xid_catalog.toml): each class of the catalog's
"Immediate Action" column holds the XIDs the catalog puts there (../shared/NOTES.md
section 11), unlisted XIDs are ``contact_support``, the severity of each class, and a
malformed catalog is refused with the reason."""

from __future__ import annotations

import pytest

from metalguard.proto.xid import (
    SEVERITY,
    XidCatalogError,
    catalog,
    classify,
    parse_catalog,
)

CLASSES = {
    "app": [8, 13, 31, 32, 43, 45, 68, 69, 94, 121, 137],
    "ignore": [63],
    "reset_gpu": [46, 48, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158],
    "reboot": [79],
    "decode": [74, 144, 145, 146, 147, 148, 149, 150, 154],
    "contact_support": [92],
    "other": [54, 151],
}


@pytest.mark.parametrize(
    ("xid", "xid_class"), [(x, c) for c, xids in CLASSES.items() for x in xids]
)
def test_each_xid_is_in_its_catalog_class(xid: int, xid_class: str) -> None:
    entry = classify(xid)
    assert entry.xid_class == xid_class
    assert entry.listed
    assert entry.action
    assert entry.severity == SEVERITY[entry.xid_class]


def test_the_shipped_catalog_lists_exactly_these() -> None:
    assert sorted(catalog()) == sorted(x for xids in CLASSES.values() for x in xids)


@pytest.mark.parametrize("xid", [1, 38, 61, 999, 10_000])
def test_an_unlisted_xid_is_contact_support(xid: int) -> None:
    entry = classify(xid)
    assert (entry.xid_class, entry.listed, entry.severity) == (
        "contact_support",
        False,
        "warning",
    )
    assert "not in NVIDIA's catalog" in entry.name


@pytest.mark.parametrize(
    ("xid", "severity"),
    [(79, "critical"), (48, "warning"), (74, "warning"), (63, "info"), (13, "warning")],
)
def test_what_isolates_and_what_costs_the_node_nothing(xid: int, severity: str) -> None:
    # only critical (a lost GPU) isolates at once (decide.is_fatal_event); a reset-needed
    # XID is graded from the batch (SUB_HEALTHY), a row remap recorded (63) and the
    # application's XIDs cost nothing
    assert classify(xid).severity == severity


def test_an_xid_without_its_own_action_takes_its_class_action() -> None:
    assert classify(46).action == "reset the GPU"
    assert classify(46).name == "XID 46"
    assert "Fabric Manager" in classify(45).action


BASE = "\n".join(
    f'[classes.{c}]\naction = "a"\nmeaning = "m"'
    for c in ("app", "ignore", "reset_gpu", "reboot", "decode", "contact_support", "other")
)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[xids\n", "xid catalog"),
        ('[classes.app]\naction = "a"\n[xids]\n', "classes must be exactly"),
        (BASE + '\n[xids]\nx = { class = "app" }\n', "not an XID number"),
        (BASE + '\n[xids]\n5 = { class = "fix_it" }\n', "no known class"),
    ],
)
def test_a_malformed_catalog_is_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(XidCatalogError, match=why):
        parse_catalog(text)
