"""A tiny reader of Prometheus text exposition lines, for comparing against node_exporter."""

from __future__ import annotations

import re

from tests.support import FIXTURES

NODE_EXPORTER_SYS = FIXTURES / "node_exporter" / "sys"
NODE_EXPORTER_EXPECTED = FIXTURES / "node_exporter" / "expected"

_LINE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Labels = frozenset[tuple[str, str]]


def _labels(text: str) -> Labels:
    pairs = []
    pos = 0
    while pos < len(text):
        match = _LABEL_RE.match(text, pos)
        if match is None:
            raise ValueError(f"bad labels: {text!r}")
        value = re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m[0]], match[2])
        pairs.append((match[1], value))
        pos = match.end()
    return frozenset(pairs)


def parse_prom(text: str) -> dict[str, dict[Labels, float]]:
    """Samples by metric name, then by label set."""
    samples: dict[str, dict[Labels, float]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = _LINE_RE.match(line)
        if match is None:
            raise ValueError(f"bad sample line: {line!r}")
        samples.setdefault(match[1], {})[_labels(match[2] or "")] = float(match[3])
    return samples


def load_expected(name: str) -> dict[str, dict[Labels, float]]:
    """node_exporter's expected samples in ``expected/<name>.prom``."""
    return parse_prom((NODE_EXPORTER_EXPECTED / f"{name}.prom").read_text())


def series(
    samples: dict[str, dict[Labels, float]], metric: str, *keys: str
) -> dict[tuple[str, ...], float]:
    """One metric's values keyed by the given label values, in order (must be unique)."""
    out: dict[tuple[str, ...], float] = {}
    for labels, value in samples[metric].items():
        as_dict = dict(labels)
        key = tuple(as_dict[k] for k in keys)
        assert key not in out, f"{metric}: {key} not unique"
        out[key] = value
    return out
