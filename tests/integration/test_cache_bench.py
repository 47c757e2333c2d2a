"""bench/cache_bench.py --quick runs end to end and prints its lines (no timing asserted).

A real HTTP object server process, a tiny generated dataset, the cache in-process, and
(as root with /dev/fuse) a real FUSE mount; without FUSE the bench prints why it skips
those lines, which this test accepts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cache_bench.py"
ROW = re.compile(
    r"^(shuffle|skewed|sequential)\s+(-|\d+%)\s+(direct|direct-end|lru|pin|auto)\s+(\d)\s+"
    r"(-|[\d.]+%)\s+[\d,]+\s+[\d.]+\s+[\d,]+\s+[\d.]+\s+\d+\s+(\d+)$"
)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.xdist_group("fuse")  # its FUSE mount: one at a time with test_cache_fuse
def test_cache_bench_quick_prints_its_lines(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"^dataset: 120 files, [\d.]+ GB \(4-32 KiB\)", out, re.M), out

    rows = [m.groups() for line in out.splitlines() if (m := ROW.match(line))]
    configs = {(p, size, policy) for p, size, policy, *_ in rows}
    expected = {  # each pattern's direct baseline, first and again last
        (pat, "-", direct)
        for pat in ("shuffle", "skewed", "sequential")
        for direct in ("direct", "direct-end")
    }
    expected |= {("shuffle", s, p) for s in ("25%", "50%", "75%") for p in ("lru", "pin", "auto")}
    expected |= {
        (pat, "50%", p) for pat in ("skewed", "sequential") for p in ("lru", "pin", "auto")
    }
    assert configs == expected, out
    assert len(rows) == 3 * len(expected), "3 epochs each"
    assert all(bad == "0" for *_, bad in rows), "every byte read equals the source's"
    assert all(hit == "-" for _, _, policy, _, hit, _ in rows if policy.startswith("direct"))
    assert out.count("    listing ") == len(expected)
    assert re.search(r"^    listing .*; policy pin \(auto: shuffled -> pin", out, re.M), out

    assert re.search(
        r"^hit ratio pin/lru epochs 2-3 at 50%: ([\d.]+x|inf) \(goal >= 3x\)$", out, re.M
    )
    assert re.search(r"^mean latency cache/direct: [\d.]+ \(goal <= 0\.4; ", out, re.M), out
    assert re.search(r"mean latency cache/direct \(direct [\d.]+ ms: [\d.]+ first, ", out), out
    assert re.search(r"^FUSE hits, 4 readers: ([\d.]+ GB/s \(goal >= 1;|skipped \(.+\))", out, re.M)
    assert "FUSE hits, 4 readers: skipped" in out or re.search(
        r"^FUSE hits, 4 readers, shards: [\d.]+ GB/s \(goal >= 1; 2 files of 1 MiB, ", out, re.M
    ), out
    assert re.search(
        r"^fsspec hits / local disk: ([\d.]+ \(goal >= 0\.7;|skipped \(.+\))", out, re.M
    )
    assert list(tmp_path.iterdir()) == [], "the bench removes its files"
