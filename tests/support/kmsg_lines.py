"""The real kernel log lines of tests/fixtures/kmsg/ (each block's source in
PROVENANCE.md) with the kind each must get: ``(where, text, kind)``, ``kind`` "none" for a
line that must not match."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures" / "kmsg"
FILES = ("gpu", "memory", "pcie", "tasks", "oom", "storage", "nic", "more", "more2")


def cases(files: tuple[str, ...] = FILES) -> list[tuple[str, str, str]]:
    """Every line of ``files`` marked ``=> kind`` (detail lines are not judged)."""
    out = []
    for name in files:
        for number, line in enumerate((FIXTURES / f"{name}.txt").read_text().splitlines(), 1):
            if not line or line.startswith("#") or "\t=> " not in line:
                continue
            text, _, kind = line.partition("\t=> ")
            out.append((f"{name}:{number}", text, kind.strip()))
    return out
