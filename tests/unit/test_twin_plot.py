"""The fleet twin's figure (metalguard/twin/plot.py): a PNG drawn from hand-made results,
and the message that says how to install matplotlib when it is missing."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from metalguard.twin import plot as twin_plot
from metalguard.twin.model import DAY_S, Fault, FaultKind, TimePoint
from tests.support.twin_results import POLICY, result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png_with_one_line_per_policy(tmp_path: Path) -> None:
    # no importorskip: matplotlib is in the dev extra, so a missing one is a failure here
    timeline = tuple(TimePoint(h * 3600.0, (h * 8) % 33, h % 4, 4) for h in range(48))
    kinds: tuple[FaultKind, ...] = ("hardware", "software", "hang", "hardware")
    faults = tuple(
        Fault(i, "twin.c0.n1", i * 0.1 * DAY_S, "x", kind, "", None, 60.0)
        for i, kind in enumerate(kinds)
    )
    results = [
        result(policy=replace(POLICY, name=name), timeline=timeline, faults=faults)
        for name in ("static", "reactive", "metalguard")
    ]
    out = tmp_path / "twin.png"
    twin_plot.plot(results, out)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000


def test_plot_needs_a_result(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        twin_plot.plot([], tmp_path / "x.png")


def test_missing_matplotlib_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(twin_plot.PlotUnavailableError, match=r"pip install 'metalguard\[twin\]'"):
        twin_plot.plot([result()], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
