"""Remediation through the BMC: power status, power-cycles, a one-time PXE boot.

Used by the controller's maintenance flow (through a node's bmc-proxy): every command
carries a ``command_id`` and is idempotent by it: repeating an id returns the first
outcome (``duplicate=True``) without acting twice, also while the first is still running,
and, with a ``store`` file, across restarts.

Actions (:data:`ACTIONS`):

- ``power_status``: read the power state, change nothing;
- ``power_cycle``: graceful: ask the OS to shut down, wait until the power is off (at most
  ``graceful_timeout_s``), power on; an off node is just powered on;
- ``force_power_cycle``: a hard ``PowerCycle`` when the BMC offers it, else force off and
  power on; an off node is just powered on;
- ``pxe_once``: one-time boot override to PXE for the next boot (no power change);
- ``power_off``: forced off (an off node stays off; provisioning's release).

Protocols: Redfish (``ComputerSystem.Reset``; ``PATCH`` of
``Boot.BootSourceOverrideTarget=Pxe`` + ``BootSourceOverrideEnabled=Once``) and IPMI
(``ipmitool chassis power status|soft|off|on|cycle``, ``chassis bootdev pxe``) where the
target's protocol is ``ipmi``.  Each outcome records ok/failed, a message and the power
state before and after; :func:`to_reply` makes it the wire's ``CommandReply``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final, Literal, Protocol, get_args

import msgspec

from metalguard.agent.bmc import ipmi, redfish
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.proto.events import CommandReply, CommandStatus

Action = Literal["power_status", "power_cycle", "force_power_cycle", "pxe_once", "power_off"]
ACTIONS: Final[tuple[str, ...]] = get_args(Action)
PowerOp = Literal["on", "force_off", "graceful_shutdown", "power_cycle"]


class RemediationError(Exception):
    """A BMC refused or failed an operation; the message says which and why."""


class RemediationOutcome(msgspec.Struct, frozen=True):
    """What one remediation command did."""

    command_id: str
    node: str
    action: str
    protocol: str
    ok: bool
    message: str = ""
    power_state_before: str = ""
    power_state_after: str = ""
    started_ts: float = 0.0
    finished_ts: float = 0.0
    duplicate: bool = False
    """Set on the answers to a repeated command id (the first outcome, not re-executed)."""


def to_reply(outcome: RemediationOutcome) -> CommandReply:
    """The outcome as the CommandReply a node answers a Command with."""
    return CommandReply(
        command_id=outcome.command_id,
        ts=outcome.finished_ts,
        ok=outcome.ok,
        status=CommandStatus.DONE if outcome.ok else CommandStatus.FAILED,
        message=outcome.message,
        duplicate=outcome.duplicate,
        result={
            "action": outcome.action,
            "protocol": outcome.protocol,
            "bmc_node": outcome.node,
            "power_state_before": outcome.power_state_before,
            "power_state_after": outcome.power_state_after,
        },
    )


class PowerControl(Protocol):
    """One BMC's power and boot controls (a logged-in session)."""

    async def power_state(self) -> str:
        """``on``, ``off``, ``powering_on``, ``powering_off`` (or what the BMC says)."""
        ...

    def supports(self, op: PowerOp) -> bool: ...

    async def power(self, op: PowerOp) -> None: ...

    async def pxe_once(self) -> str:
        """Set a one-time PXE boot override; return what the BMC now reports."""
        ...


# --- Redfish -----------------------------------------------------------------------------

_RESET_TYPES: Final[dict[str, tuple[str, ...]]] = {
    "on": ("On", "ForceOn", "PushPowerButton"),
    "force_off": ("ForceOff",),
    "graceful_shutdown": ("GracefulShutdown",),
    "power_cycle": ("PowerCycle",),
}
"""Our operation -> ComputerSystem.Reset ResetTypes to use, in order of preference."""


def reset_type(op: PowerOp, allowed: list[str] | None) -> str | None:
    """The ResetType for ``op`` among the allowable values (all allowed when unlisted)."""
    for candidate in _RESET_TYPES[op]:
        if allowed is None or candidate in allowed:
            return candidate
    return None


def boot_override_patch() -> dict[str, Any]:
    """The PATCH body of a one-time PXE boot override (DSP0268 ComputerSystem.Boot)."""
    return {"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}


class RedfishPower:
    """PowerControl over a logged-in :class:`agent.bmc.redfish.RedfishClient`."""

    def __init__(self, client: redfish.RedfishClient) -> None:
        self.client = client
        self.system_uri = ""
        self._reset_target = ""
        self._allowed: list[str] | None = None

    async def _system(self) -> tuple[dict[str, Any], str]:
        if not self.system_uri:
            uri, doc, etag = await redfish.first_system(self.client)
            self.system_uri = uri
            action = doc.get("Actions", {}).get("#ComputerSystem.Reset", {})
            self._reset_target = action.get("target", f"{uri}/Actions/ComputerSystem.Reset")
            allowed = action.get("ResetType@Redfish.AllowableValues")
            self._allowed = list(allowed) if isinstance(allowed, list) else None
            return doc, etag
        return await self.client.get(self.system_uri)

    async def power_state(self) -> str:
        doc, _ = await self._system()
        return redfish.power_state(doc.get("PowerState"))

    def supports(self, op: PowerOp) -> bool:
        return reset_type(op, self._allowed) is not None

    async def power(self, op: PowerOp) -> None:
        await self._system()
        kind = reset_type(op, self._allowed)
        if kind is None:
            raise RemediationError(f"the BMC offers no ResetType for {op} ({self._allowed})")
        await self.client.post(self._reset_target, {"ResetType": kind})

    async def pxe_once(self) -> str:
        doc, etag = await self._system()
        allowed = doc.get("Boot", {}).get("BootSourceOverrideTarget@Redfish.AllowableValues")
        if isinstance(allowed, list) and "Pxe" not in allowed:
            raise RemediationError(f"the BMC does not offer a Pxe boot override ({allowed})")
        await self.client.patch(self.system_uri, boot_override_patch(), etag)
        after, _ = await self.client.get(self.system_uri)
        boot = after.get("Boot", {})
        target, enabled = (
            boot.get("BootSourceOverrideTarget"),
            boot.get("BootSourceOverrideEnabled"),
        )
        if (target, enabled) != ("Pxe", "Once"):
            raise RemediationError(
                f"the BMC accepted the override but reports target={target} enabled={enabled}"
            )
        return "boot override: Pxe, Once"


# --- IPMI --------------------------------------------------------------------------------

_IPMI_POWER: Final[dict[str, str]] = {
    "on": "on",
    "force_off": "off",
    "graceful_shutdown": "soft",
    "power_cycle": "cycle",
}


class IpmiPower:
    """PowerControl through ``ipmitool`` (lanplus); ``tool`` overrides the executable."""

    def __init__(self, target: BmcTarget, user: str, password: str, tool: str = "") -> None:
        self.target = target
        self.user = user
        self.env = ipmi.tool_env(password)
        self.tool = tool
        self.budget_s = target.timeout_s * (target.retries + 1) + 1.0

    async def _run(self, *command: str) -> str:
        argv = ipmi.ipmitool_argv(self.target, self.user, *command)
        if self.tool:
            argv[0] = self.tool
        result = await ipmi.run_tool(argv, self.budget_s, self.env)
        if not result.ok:
            raise RemediationError(result.message)
        return result.stdout

    async def power_state(self) -> str:
        state = ipmi.parse_chassis_power(await self._run("chassis", "power", "status"))
        if not state:
            raise RemediationError("ipmitool chassis power status: unrecognised answer")
        return state

    def supports(self, op: PowerOp) -> bool:
        return True

    async def power(self, op: PowerOp) -> None:
        await self._run("chassis", "power", _IPMI_POWER[op])

    async def pxe_once(self) -> str:
        out = await self._run("chassis", "bootdev", "pxe")  # next boot only by default
        return out.strip() or "boot device: pxe (next boot)"


# --- the executor ------------------------------------------------------------------------

Opener = Callable[[BmcTarget], contextlib.AbstractAsyncContextManager[PowerControl]]
"""Opens a target's PowerControl (:func:`open_control`; tests pass their own options)."""


@contextlib.asynccontextmanager
async def open_control(
    target: BmcTarget, *, cafile: str | None = None, tool: str = ""
) -> AsyncIterator[PowerControl]:
    """A PowerControl for a target, by its protocol (``redfish`` or ``ipmi``)."""
    if target.protocol == "redfish":
        async with redfish.client_for(target, cafile=cafile) as client:
            yield RedfishPower(client)
    elif target.protocol == "ipmi":
        user, password = ipmi.credentials_of(target)
        yield IpmiPower(target, user, password, tool)
    else:
        raise RemediationError(
            f"protocol {target.protocol} has no power control (use redfish or ipmi)"
        )


class Remediator:
    """Executes remediation commands once per command id and keeps their outcomes.

    ``clock`` stamps outcomes; ``sleep`` and ``poll_s`` pace the power-state polls while
    waiting for a transition (at most ``graceful_timeout_s`` for a graceful shutdown,
    ``transition_timeout_s`` otherwise).  ``store``: a JSON-lines file the outcomes are
    appended to and reloaded from, so a restart does not act twice on a repeated id; the
    newest ``max_records`` outcomes are kept.
    """

    def __init__(
        self,
        *,
        opener: Opener = open_control,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        poll_s: float = 2.0,
        graceful_timeout_s: float = 300.0,
        transition_timeout_s: float = 60.0,
        store: Path | None = None,
        max_records: int = 1000,
    ) -> None:
        self._opener = opener
        self._clock = clock
        self._sleep = sleep
        self.poll_s = poll_s
        self.graceful_timeout_s = graceful_timeout_s
        self.transition_timeout_s = transition_timeout_s
        self._store = store
        self._max = max_records
        self._done: OrderedDict[str, RemediationOutcome] = OrderedDict()
        self._running: dict[str, asyncio.Task[RemediationOutcome]] = {}
        if store is not None:
            self._load(store)

    def _load(self, store: Path) -> None:
        try:
            lines = store.read_bytes().splitlines()
        except FileNotFoundError:
            return
        decoder = msgspec.json.Decoder(RemediationOutcome)
        for line in lines:
            with contextlib.suppress(msgspec.DecodeError):
                outcome = decoder.decode(line)
                self._remember(outcome)

    def _remember(self, outcome: RemediationOutcome) -> None:
        self._done[outcome.command_id] = outcome
        self._done.move_to_end(outcome.command_id)
        while len(self._done) > self._max:
            self._done.popitem(last=False)

    def _persist(self, outcome: RemediationOutcome) -> None:
        if self._store is None:
            return
        self._store.parent.mkdir(parents=True, exist_ok=True)
        with self._store.open("ab") as f:
            f.write(msgspec.json.encode(outcome) + b"\n")
        if len(self._done) >= self._max and self._store.stat().st_size > 0:
            kept = b"".join(msgspec.json.encode(o) + b"\n" for o in self._done.values())
            tmp = self._store.with_suffix(".tmp")
            tmp.write_bytes(kept)
            tmp.replace(self._store)

    def outcome(self, command_id: str) -> RemediationOutcome | None:
        """The recorded outcome of a command id, if it has finished."""
        return self._done.get(command_id)

    async def execute(self, command_id: str, target: BmcTarget, action: str) -> RemediationOutcome:
        """Run ``action`` on ``target``'s BMC once for ``command_id``; never raises for a
        BMC failure (that is an outcome with ``ok=False``)."""
        if (done := self._done.get(command_id)) is not None:
            return msgspec.structs.replace(done, duplicate=True)
        if (running := self._running.get(command_id)) is not None:
            first = await asyncio.shield(running)
            return msgspec.structs.replace(first, duplicate=True)
        task = asyncio.ensure_future(self._execute(command_id, target, action))
        self._running[command_id] = task  # a cancelled caller does not stop the action
        task.add_done_callback(lambda _: self._running.pop(command_id, None))
        return await asyncio.shield(task)

    async def _execute(self, command_id: str, target: BmcTarget, action: str) -> RemediationOutcome:
        started = self._clock()
        steps = _Steps()
        try:
            if action not in ACTIONS:
                raise RemediationError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
            async with self._opener(target) as control:
                try:
                    message = await self._act(control, action, steps)
                finally:
                    if steps.before and not steps.after:  # failed half-way: where is it now?
                        with contextlib.suppress(Exception):
                            steps.after = await control.power_state()
            ok = True
        except (RemediationError, redfish.RedfishError) as exc:
            ok, message = False, str(exc)
        except (TimeoutError, OSError) as exc:
            ok, message = False, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a credentials file error, an unexpected answer
            ok, message = False, f"{type(exc).__name__}: {exc}"
        outcome = RemediationOutcome(
            command_id=command_id,
            node=target.node,
            action=action,
            protocol=target.protocol,
            ok=ok,
            message=message,
            power_state_before=steps.before,
            power_state_after=steps.after,
            started_ts=started,
            finished_ts=self._clock(),
        )
        self._remember(outcome)
        self._persist(outcome)
        return outcome

    async def _act(self, control: PowerControl, action: str, steps: _Steps) -> str:
        steps.before = await control.power_state()
        message = ""
        if action == "power_status":
            message = f"power is {steps.before}"
        elif action == "pxe_once":
            message = await control.pxe_once()
        elif action == "power_off":
            if steps.before == "off":
                message = "was off"
            else:
                await control.power("force_off")
                await self._wait_for(control, "off", self.transition_timeout_s)
                message = "forced off"
        elif steps.before in ("off", "powering_off"):
            if steps.before == "powering_off":
                await self._wait_for(control, "off", self.transition_timeout_s)
            await control.power("on")
            message = "was off: powered on"
        elif action == "power_cycle":
            await control.power("graceful_shutdown")
            await self._wait_for(control, "off", self.graceful_timeout_s)
            await control.power("on")
            message = "graceful shutdown, then powered on"
        else:  # force_power_cycle
            if control.supports("power_cycle"):
                await control.power("power_cycle")
                message = "hard power cycle"
            else:
                await control.power("force_off")
                await self._wait_for(control, "off", self.transition_timeout_s)
                await control.power("on")
                message = "forced off, then powered on"
        if action in ("power_cycle", "force_power_cycle"):
            await self._wait_for(control, "on", self.transition_timeout_s)
        steps.after = await control.power_state()
        return message

    async def _wait_for(self, control: PowerControl, want: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (state := await control.power_state()) != want:
            if time.monotonic() >= deadline:
                raise RemediationError(
                    f"power did not become {want} within {timeout_s:g}s (now {state})"
                )
            await self._sleep(self.poll_s)


class _Steps:
    """Power states seen while acting (kept when an action fails half-way)."""

    def __init__(self) -> None:
        self.before = ""
        self.after = ""
