"""bench/proto_bench.py runs and prints its figures (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "proto_bench.py"
ROW = re.compile(
    r"^(msgpack|json|stdlib json)\s+(encode|decode)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)x$"
)


def test_proto_bench_quick_prints_the_table() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "8 GPUs, 16 DIMMs, 12 PCIe (full AER), 10 disks, 12 fans" in out

    rows = {(m.group(1), m.group(2)): m for line in out.splitlines() if (m := ROW.match(line))}
    expected = {(c, op) for c in ("msgpack", "json", "stdlib json") for op in ("encode", "decode")}
    assert set(rows) == expected, out
    for m in rows.values():
        assert int(m.group(3).replace(",", "")) > 0, "msg/s"
        assert int(m.group(4).replace(",", "")) > 1000, "bytes per message of a full batch"
    assert float(rows["json", "encode"].group(5)) == 1.0, "JSON is the baseline"
    assert rows["msgpack", "encode"].group(4) == rows["msgpack", "decode"].group(4)
    assert int(rows["msgpack", "encode"].group(4).replace(",", "")) < int(
        rows["json", "encode"].group(4).replace(",", "")
    ), "msgpack is the smaller encoding"
    assert re.search(r"^encode: msgpack/JSON = [\d.]+x", out, re.M)
    assert re.search(r"^decode: msgpack/JSON = [\d.]+x", out, re.M)
