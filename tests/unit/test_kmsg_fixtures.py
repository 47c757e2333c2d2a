"""The shipped kernel log rules on real kernel log lines copied from public sources
(tests/fixtures/kmsg/, each block's source in PROVENANCE.md): every line marked
``=> <kind>`` gets that kind, every line marked ``=> none`` gets none (or is a known
harmless flood the rules ignore); unmarked lines (detail lines of a multi-line report)
are not judged."""

from __future__ import annotations

import pytest

from metalguard.agent.kmsg.record import text_record
from metalguard.agent.kmsg.rules import Finding, Ignored, match, shipped_rules
from tests.support.kmsg_lines import FIXTURES, cases

CASES = cases()


def test_the_fixtures_cover_every_kind() -> None:
    from metalguard.agent.kmsg.rules import KINDS

    assert {kind for _, _, kind in CASES} >= set(KINDS)


@pytest.mark.parametrize(("where", "text", "kind"), CASES, ids=[c[0] for c in CASES])
def test_a_real_line(where: str, text: str, kind: str) -> None:
    found = match(text_record(text), shipped_rules())
    if kind == "none":
        assert found is None or isinstance(found, Ignored), (where, found)
    else:
        assert isinstance(found, Finding), (where, text)
        assert found.kind == kind, (where, found.rule, text)


def test_raw_records_parse_or_are_refused_with_a_reason() -> None:
    """kmsg_records.txt: records in /dev/kmsg's own format (and netconsole's, which
    prepends the kernel release: refused as not the format, never a traceback)."""
    from metalguard.agent.kmsg.record import KmsgFormatError, parse_record, split_records

    text = "\n".join(
        line
        for line in (FIXTURES / "kmsg_records.txt").read_text().splitlines()
        if not line.startswith("#")
    )
    parsed, refused = 0, 0
    for raw in split_records(text):
        try:
            parse_record(raw)
        except KmsgFormatError:
            refused += 1
        else:
            parsed += 1
    assert parsed >= 10
