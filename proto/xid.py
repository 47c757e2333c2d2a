"""NVIDIA's XID catalog as data: each XID's class (what to do about it), from
``xid_catalog.toml`` beside this module (its header names the source).

Shared by every XID source, the agent's NVML watcher now and the kernel log later, and by
the controller: :func:`classify` is the one lookup. Pure; the file is read once.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Final, Literal, cast, get_args

XidClass = Literal["app", "ignore", "reset_gpu", "reboot", "decode", "contact_support", "other"]
UNLISTED_CLASS: Final[XidClass] = "contact_support"
"""The class of an XID the catalog does not list."""
SEVERITY: Final[dict[XidClass, str]] = {
    "app": "warning",
    "ignore": "info",
    "reset_gpu": "warning",
    "reboot": "critical",
    "decode": "warning",
    "contact_support": "warning",
    "other": "warning",
}
"""The NodeEvent severity of each class. Only ``critical`` isolates the node at once
(``decide.is_fatal_event``): a GPU lost until the node is power-cycled. A GPU that needs a
reset is graded from the agent's batch (``GpuDevice.xid_errors``: SUB_HEALTHY, reset once
drained, docs/decisions.md); the application's XIDs cost the node nothing."""


@dataclass(frozen=True, slots=True)
class XidEntry:
    """One XID as the catalog describes it."""

    xid: int
    xid_class: XidClass
    name: str
    action: str
    listed: bool
    """In the catalog (False: unlisted, ``contact_support``)."""

    @property
    def severity(self) -> str:
        """The severity a ``gpu_xid`` event of this XID carries (:data:`SEVERITY`)."""
        return SEVERITY[self.xid_class]


class XidCatalogError(ValueError):
    """The catalog file is malformed (a release bug: the tests read it)."""


def parse_catalog(text: str) -> dict[int, XidEntry]:
    """The entries of a catalog TOML document; XidCatalogError naming what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise XidCatalogError(f"xid catalog: {exc}") from None
    classes = doc.get("classes", {})
    if set(classes) != set(get_args(XidClass)):
        raise XidCatalogError(f"xid catalog: classes must be exactly {get_args(XidClass)}")
    entries: dict[int, XidEntry] = {}
    for key, row in doc.get("xids", {}).items():
        try:
            xid = int(key)
        except ValueError:
            raise XidCatalogError(f"xid catalog: {key!r} is not an XID number") from None
        cls = row.get("class")
        if cls not in classes:
            raise XidCatalogError(f"xid catalog: XID {xid} has no known class ({cls!r})")
        entries[xid] = XidEntry(
            xid=xid,
            xid_class=cast("XidClass", cls),
            name=str(row.get("name") or f"XID {xid}"),
            action=str(row.get("action") or classes[cls]["action"]),
            listed=True,
        )
    return entries


@cache
def catalog() -> dict[int, XidEntry]:
    """The shipped catalog (read once)."""
    text = resources.files("metalguard.proto").joinpath("xid_catalog.toml").read_text("utf-8")
    return parse_catalog(text)


def classify(xid: int) -> XidEntry:
    """What the catalog says about ``xid``; an unlisted one is ``contact_support``."""
    entry = catalog().get(xid)
    if entry is not None:
        return entry
    return XidEntry(
        xid=xid,
        xid_class=UNLISTED_CLASS,
        name=f"XID {xid} (not in NVIDIA's catalog)",
        action="contact support",
        listed=False,
    )
