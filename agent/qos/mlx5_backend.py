"""The mlx5 backend: DCQCN knobs under ``<sysfs>/class/net/<if>/ecn/roce_np|roce_rp/``.

Each knob is one file holding an integer; writing it and reading it back is the whole
protocol.  The sysfs root is configurable so that tests run on a fake tree.  An
interface without the ``ecn`` directory (not mlx5) is unsupported, not an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from metalguard.agent.qos.plan import Mlx5Plan

SIDES = ("np", "rp")


class Mlx5Error(RuntimeError):
    """A knob exists but could not be written or read; the message names it."""


def ecn_dir(sysfs: Path, ifname: str) -> Path:
    """The interface's DCQCN directory."""
    return sysfs / "class" / "net" / ifname / "ecn"


def _knob(sysfs: Path, ifname: str, side: str, name: str) -> Path:
    return ecn_dir(sysfs, ifname) / f"roce_{side}" / name


def apply(ifname: str, plan: Mlx5Plan, sysfs: Path) -> tuple[dict[str, int | None], list[str]]:
    """Write every knob; returns the values to expect and the unsupported parts (no ecn
    directory, a knob the driver does not expose)."""
    if not ecn_dir(sysfs, ifname).is_dir():
        return {}, [f"{ifname}: mlx5: no DCQCN sysfs directory ({ecn_dir(sysfs, ifname)})"]
    expected: dict[str, int | None] = {}
    unsupported: list[str] = []
    for side in SIDES:
        for name, value in getattr(plan, side).items():
            path = _knob(sysfs, ifname, side, name)
            if not path.exists():
                unsupported.append(f"{ifname}: mlx5: roce_{side}/{name} is not exposed")
                continue
            try:
                path.write_text(f"{value}\n", encoding="ascii")
            except OSError as exc:
                raise Mlx5Error(f"{ifname}: mlx5: cannot write roce_{side}/{name}: {exc}") from None
            expected[f"{side}.{name}"] = value
    return expected, unsupported


def read_state(ifname: str, keys: Iterable[str], sysfs: Path) -> dict[str, int | None]:
    """``side.name`` -> the knob's value (None when missing or unreadable)."""
    out: dict[str, int | None] = {}
    for key in keys:
        side, name = key.split(".", 1)
        try:
            text = _knob(sysfs, ifname, side, name).read_text(encoding="ascii")
            out[key] = int(text.strip())
        except (OSError, ValueError):
            out[key] = None
    return out


def differences(expected: dict[str, int | None], actual: dict[str, int | None]) -> list[str]:
    """What differs, one readable line each."""
    return [
        f"mlx5 roce_{key.replace('.', '/')}: expected {want}, found {actual.get(key)}"
        for key, want in expected.items()
        if actual.get(key) != want
    ]
