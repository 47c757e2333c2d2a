"""Real PCI configuration space dumps (tests/fixtures/iommu/lspci/, PROVENANCE.md
there) and lspci's decodings of them: the bytes, and the ACS / ATS bits as lspci printed
them and as the agent's parser reads them."""

from __future__ import annotations

import re
from pathlib import Path

from metalguard.agent.collectors.iommu_parse import acs, acs_bits, ats_enabled

LSPCI = Path(__file__).parents[1] / "fixtures" / "iommu" / "lspci"
DUMPS = sorted(LSPCI.glob("*.lspci-xxxx.txt"))
NAMES = {"SrcValid": "SV", "TransBlk": "TB", "ReqRedir": "RR", "CmpltRedir": "CR",
         "UpstreamFwd": "UF", "EgressCtrl": "EC", "DirectTrans": "DT"}  # fmt: skip
_HEX = re.compile(r"^([0-9a-f]{2,3}): ((?:[0-9a-f]{2} ?){16})\s*$")


def config_of(dump: Path) -> bytes:
    """The bytes of one ``lspci -x...`` dump (its hex lines, in order)."""
    data = bytearray()
    for line in dump.read_text().splitlines():
        if m := _HEX.match(line.strip()):
            assert int(m.group(1), 16) == len(data), (dump.name, line)
            data += bytes.fromhex(m.group(2))
    return bytes(data)


def decoded(text: str) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, bool | None]:
    """lspci's ACSCap and ACSCtl bits that are ``+``, and ATSCtl's Enable (None: absent)."""

    def bits(label: str) -> tuple[str, ...] | None:
        m = re.search(rf"{label}:\s*(.*)", text)
        if m is None:
            return None
        on = {w[:-1] for w in m.group(1).split() if w.endswith("+")}
        return tuple(short for name, short in NAMES.items() if name in on)

    ats = re.search(r"ATSCtl:\s*Enable([+-])", text)
    return bits("ACSCap"), bits("ACSCtl"), None if ats is None else ats.group(1) == "+"


def ours(config: bytes) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, bool | None]:
    regs = acs(config)
    if regs is None:
        return None, None, ats_enabled(config)
    return acs_bits(regs.cap), acs_bits(regs.ctl), ats_enabled(config)


def published(dump: Path) -> Path | None:
    for suffix in (".lspci-vvv.txt", ".lspci-vvvv.txt"):
        text = dump.with_name(dump.name.replace(".lspci-xxxx.txt", suffix))
        if text.exists():
            return text
    return None


_GROUP_LINE = re.compile(
    r"IOMMU Group (?P<group>\d+):?\s*(?P<bdf>(?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])?"
    r"(?:.*?\[(?P<cls>[0-9a-f]{4})\]:)?"
)
_MEMBER_LINE = re.compile(
    r"^\s*(?:# )?(?P<bdf>(?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) "
    r".*?\[(?P<cls>[0-9a-f]{4})\]:"
)


def group_listing(text: str) -> dict[str, list[tuple[str, str]]]:
    """A published IOMMU group listing (``IOMMU Group N BDF desc [cccc]: ...`` one a line,
    or ``IOMMU Group N:`` then the members indented): group -> [(address with its domain,
    class as ``0xcccc00``)]."""
    groups: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for line in text.splitlines():
        head = line.lstrip("# ")
        if head.startswith("IOMMU Group"):
            m = _GROUP_LINE.match(head)
            assert m is not None, line
            current = m.group("group")
            groups.setdefault(current, [])
            if m.group("bdf") and m.group("cls"):
                groups[current].append((_domain(m.group("bdf")), f"0x{m.group('cls')}00"))
        elif current and (m := _MEMBER_LINE.match(line)):
            groups[current].append((_domain(m.group("bdf")), f"0x{m.group('cls')}00"))
    return groups


def _domain(bdf: str) -> str:
    return bdf if bdf.count(":") == 2 else f"0000:{bdf}"
