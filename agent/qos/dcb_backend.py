"""The dcb backend: PFC, ETS and the DSCP app table through iproute2's ``dcb`` tool.

A driver without DCB netlink ops (veth, most non-RDMA NICs) answers "Operation not
supported": the whole part is then reported unsupported, without error.  Synchronous;
the reconciler runs it in a thread.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import msgspec

from metalguard.agent.qos.plan import DcbPlan

DCB_TIMEOUT_S = 10.0
NUM_PRIOS = 8
_UNSUPPORTED = ("operation not supported", "not supported")


class DcbError(RuntimeError):
    """The device supports DCB but refused a setting; the message says which."""


class DcbState(msgspec.Struct, frozen=True, kw_only=True):
    """What a DcbPlan determines, as read back."""

    pfc: tuple[bool, ...] = ()
    prio_tc: tuple[int, ...] = ()
    tc_bw: tuple[int, ...] = ()
    dscp_prio: frozenset[tuple[int, int]] = frozenset()


def _run(netns: str | None, args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [*(["ip", "netns", "exec", netns] if netns else []), "dcb", *args]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=DCB_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 127, "", f"cannot run dcb: {exc}")


def _unsupported(done: subprocess.CompletedProcess[str]) -> bool:
    text = (done.stderr + done.stdout).lower()
    return done.returncode == 127 or any(word in text for word in _UNSUPPORTED)


def _why(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stderr or done.stdout).strip() or f"dcb exited {done.returncode}"


def probe(ifname: str, netns: str | None = None) -> str:
    """ "" when the interface speaks DCB, else why it does not (the part is unsupported)."""
    done = _run(netns, ["-j", "pfc", "show", "dev", ifname])
    if done.returncode == 0:
        return ""
    if _unsupported(done):
        return f"{ifname}: dcb: the driver has no DCB support ({_why(done)})"
    raise DcbError(f"{ifname}: dcb pfc show failed: {_why(done)}")


def expected_state(plan: DcbPlan) -> DcbState:
    """The state the plan sets."""
    return DcbState(
        pfc=tuple(p in plan.pfc_priorities for p in range(NUM_PRIOS)),
        prio_tc=tuple(plan.prio_tc.get(p, 0) for p in range(NUM_PRIOS)) if plan.tc_bw else (),
        tc_bw=_tc_bw(plan) if plan.tc_bw else (),
        dscp_prio=frozenset(plan.dscp_prio.items()),
    )


def _tc_bw(plan: DcbPlan) -> tuple[int, ...]:
    """ETS shares of the non-strict classes scaled to sum to 100, padded to 8 TCs."""
    shares = [0 if strict else bw for bw, strict in zip(plan.tc_bw, plan.tc_strict, strict=True)]
    total = sum(shares)
    if total:
        scaled = [round(s * 100 / total) for s in shares]
        first = next(i for i, s in enumerate(shares) if s)
        scaled[first] += 100 - sum(scaled)
        shares = scaled
    return tuple(shares + [0] * (NUM_PRIOS - len(shares)))


def apply(ifname: str, plan: DcbPlan, netns: str | None = None) -> str:
    """Set PFC, ETS and the DSCP app table; "" when done, else why it is unsupported."""
    why = probe(ifname, netns)
    if why:
        return why
    want = expected_state(plan)
    pfc = " ".join(f"{p}:{'on' if on else 'off'}" for p, on in enumerate(want.pfc))
    _set(netns, ifname, ["pfc", "set", "dev", ifname, "prio-pfc", *pfc.split()])
    if want.tc_bw:
        tsa = [
            f"{i}:{'strict' if i < len(plan.tc_strict) and plan.tc_strict[i] else 'ets'}"
            for i in range(NUM_PRIOS)
        ]
        _set(
            netns,
            ifname,
            [
                "ets", "set", "dev", ifname,
                "prio-tc", *(f"{p}:{tc}" for p, tc in enumerate(want.prio_tc)),
                "tc-tsa", *tsa,
                "tc-bw", *(f"{i}:{bw}" for i, bw in enumerate(want.tc_bw)),
            ],
        )  # fmt: skip
    _run(netns, ["app", "flush", "dev", ifname, "dscp-prio"])
    if want.dscp_prio:
        pairs = [f"{d}:{p}" for d, p in sorted(want.dscp_prio)]
        _set(netns, ifname, ["app", "replace", "dev", ifname, "dscp-prio", *pairs])
    return ""


def _set(netns: str | None, ifname: str, args: list[str]) -> None:
    done = _run(netns, args)
    if done.returncode != 0:
        raise DcbError(f"{ifname}: dcb {' '.join(args[:2])} failed: {_why(done)}")


def read_state(ifname: str, netns: str | None = None) -> DcbState:
    """PFC, ETS and the DSCP app table as the driver reports them."""
    pfc = _show(netns, ["pfc", "show", "dev", ifname, "prio-pfc"])
    ets = _show(netns, ["ets", "show", "dev", ifname, "prio-tc", "tc-bw"])
    app = _show(netns, ["app", "show", "dev", ifname, "dscp-prio"])
    return DcbState(
        pfc=tuple(bool(x) for x in _array(pfc.get("prio_pfc"))),
        prio_tc=tuple(int(x) for x in _array(ets.get("prio_tc"))),
        tc_bw=tuple(int(x) for x in _array(ets.get("tc_bw"))),
        dscp_prio=frozenset(_pairs(app.get("dscp_prio"))),
    )


def _show(netns: str | None, args: list[str]) -> dict[str, Any]:
    done = _run(netns, ["-j", *args])
    if done.returncode != 0:
        raise DcbError(f"dcb {' '.join(args)} failed: {_why(done)}")
    try:
        data = json.loads(done.stdout or "{}")
    except json.JSONDecodeError as exc:
        raise DcbError(f"dcb {' '.join(args)}: not JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _array(value: Any) -> list[Any]:
    """An 8-entry dcb array, printed as a JSON list or as an object keyed by index."""
    if isinstance(value, dict):
        return [value[k] for k in sorted(value, key=int)]
    return list(value) if isinstance(value, list) else []


def _pairs(value: Any) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for item in value if isinstance(value, list) else []:
        if isinstance(item, list) and len(item) == 2:
            out.append((int(item[0]), int(item[1])))
        elif isinstance(item, dict) and len(item) == 1:
            ((k, v),) = item.items()
            out.append((int(k), int(v)))
    return out


def differences(expected: DcbState, actual: DcbState) -> list[str]:
    """What differs, one readable line each."""
    out: list[str] = []
    for field in ("pfc", "prio_tc", "tc_bw"):
        want, got = getattr(expected, field), getattr(actual, field)
        if want and tuple(want) != tuple(got[: len(want)]):
            out.append(f"dcb {field}: expected {list(want)}, found {list(got)}")
    if expected.dscp_prio != actual.dscp_prio:
        out.append(
            f"dcb app dscp-prio: expected {sorted(expected.dscp_prio)}, "
            f"found {sorted(actual.dscp_prio)}"
        )
    return out
