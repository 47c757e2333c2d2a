#!/usr/bin/env python3
"""A deterministic stand-in for a training job (docs/workloads.md).

Its state is a SHA-256 chain, ``state[i+1] = sha256(state[i] || i)``, so the final line
``digest=<hex>`` depends only on the number of steps completed: the same whether or not
the run was interrupted and resumed from a checkpoint.  Standard library only; it uses the
metalguard client library when importable (``--no-client`` never imports it: SIGUSR1 only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

SEED = b"metalguard-trainer"
CKPT_NAME = re.compile(r"^ckpt-(\d{8})\.json$")
EXIT_STOPPED = 143


def initial_state() -> bytes:
    """The state before step 0."""
    return hashlib.sha256(SEED).digest()


def advance(state: bytes, step: int) -> bytes:
    """The state after step ``step`` (0-based) is done."""
    return hashlib.sha256(state + step.to_bytes(8, "big")).digest()


def state_after(steps: int) -> bytes:
    """The state after ``steps`` steps from scratch (what an uninterrupted run reaches)."""
    state = initial_state()
    for i in range(steps):
        state = advance(state, i)
    return state


def digest_after(steps: int) -> str:
    """The ``digest=`` value of a run of ``steps`` steps."""
    return state_after(steps).hex()


def _check(step: int, state_hex: str) -> str:
    return hashlib.sha256(f"{step}:{state_hex}".encode()).hexdigest()[:16]


def write_checkpoint(directory: Path, step: int, state: bytes) -> Path:
    """Write ``ckpt-<step>.json`` atomically (tmp file + rename); return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{step:08d}.json"
    body = {"step": step, "state": state.hex(), "check": _check(step, state.hex())}
    tmp = directory / f".ckpt-{step:08d}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Path) -> tuple[int, bytes] | None:
    """(step, state) of a valid checkpoint file, else None."""
    try:
        body = json.loads(path.read_text())
        step, state_hex = int(body["step"]), str(body["state"])
        if body.get("check") != _check(step, state_hex) or step < 0:
            return None
        return step, bytes.fromhex(state_hex)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newest_checkpoint(directory: Path) -> Path | None:
    """The valid checkpoint with the highest step in ``directory``."""
    if not directory.is_dir():
        return None
    found = sorted(
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := CKPT_NAME.match(p.name)) is not None
    )
    for _step, path in reversed(found):
        if read_checkpoint(path) is not None:
            return path
    return None


class _Client(Protocol):
    def report_progress(self, step: int) -> None: ...
    def checkpoint_requested(self) -> bool: ...
    def checkpoint_done(self, step: int, path: str) -> None: ...
    def close(self) -> None: ...


class _SignalOnly:
    """What the trainer uses without the client library: SIGUSR1 only."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGUSR1, self._on_usr1)

    def _on_usr1(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True

    def report_progress(self, step: int) -> None:
        pass

    def checkpoint_requested(self) -> bool:
        return self.requested

    def checkpoint_done(self, step: int, path: str) -> None:
        self.requested = False

    def close(self) -> None:
        pass


def _client(use_library: bool) -> _Client:
    if use_library:
        try:
            from metalguard import checkpoint as client
        except ImportError:
            pass
        else:
            return client.connect()
    return _SignalOnly()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (docs/workloads.md)."""
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--checkpoint-dir", default=env.get("MG_CHECKPOINT_DIR") or "checkpoints")
    p.add_argument(
        "--checkpoint-every", type=float, default=float(env.get("MG_CHECKPOINT_EVERY") or 0)
    )
    p.add_argument("--resume", default=env.get("MG_RESUME_FROM") or "none")
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=None, help="default: every rank")
    p.add_argument("--faults-only-fresh", action="store_true")
    p.add_argument("--no-client", action="store_true")
    return p.parse_args(argv)


def _resume(args: argparse.Namespace, ckpt_dir: Path) -> tuple[int, bytes, Path | None]:
    if args.resume == "none":
        return 0, initial_state(), None
    path = newest_checkpoint(ckpt_dir) if args.resume == "auto" else Path(args.resume)
    if path is None:
        return 0, initial_state(), None
    loaded = read_checkpoint(path)
    if loaded is None:
        print(f"invalid checkpoint {path}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return loaded[0], loaded[1], path


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; return the exit status."""
    args = parse_args(argv)
    rank = int(os.environ.get("MG_RANK") or 0)
    ckpt_dir = Path(args.checkpoint_dir)
    step, state, resumed = _resume(args, ckpt_dir)
    if resumed is not None:
        print(f"resumed step={step} path={resumed}", flush=True)
    faults_on = (args.fault_rank is None or args.fault_rank == rank) and not (
        args.faults_only_fresh and resumed is not None
    )
    stop: dict[str, Any] = {"now": False}

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    wl = _client(not args.no_client)
    wl.report_progress(step)
    print(f"start step={step} rank={rank}", flush=True)  # signal handlers are in place
    last_periodic = time.monotonic()
    while step < args.steps:
        if faults_on and args.crash_at_step is not None and step >= args.crash_at_step:
            print(f"crash step={step}", flush=True)
            return 1
        if faults_on and args.hang_at_step is not None and step >= args.hang_at_step:
            print(f"hang step={step}", flush=True)
            while not stop["now"]:  # no step is ever taken again; SIGTERM still ends it
                time.sleep(0.05)
            return EXIT_STOPPED
        time.sleep(args.step_seconds)
        state = advance(state, step)
        step += 1
        wl.report_progress(step)
        if stop["now"]:
            path = write_checkpoint(ckpt_dir, step, state)
            wl.checkpoint_done(step, str(path))
            print(f"checkpoint step={step} path={path}", flush=True)
            print(f"stopped step={step}", flush=True)
            wl.close()
            return EXIT_STOPPED
        periodic = args.checkpoint_every > 0 and (
            time.monotonic() - last_periodic >= args.checkpoint_every
        )
        if wl.checkpoint_requested() or periodic:
            path = write_checkpoint(ckpt_dir, step, state)
            wl.checkpoint_done(step, str(path))
            last_periodic = time.monotonic()
            print(f"checkpoint step={step} path={path}", flush=True)
    wl.close()
    print(f"steps={step}", flush=True)
    print(f"digest={state.hex()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
