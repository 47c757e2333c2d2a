#!/usr/bin/env python3
"""A real PyTorch DistributedDataParallel job over gloo on CPU (docs/workloads.md).

Every rank trains the same small regression model on its own deterministic batches
(seeded by step and rank), so a run resumed from a checkpoint continues the loss curve
exactly and ends with the same ``digest=<hex>`` of its parameters.  Rendezvous, rank and
checkpoint settings come from the ``MG_*`` environment the agent's runner sets.

Checkpoints are taken by every rank at the same step: a request (the agent's, through
the client library, or SIGUSR1) or a SIGTERM on any rank is all-reduced, rank 0 writes
``ckpt-<step:08d>.pt`` atomically, and every rank reports that path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

CKPT_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
EXIT_STOPPED = 143
FEATURES = 16
TRUE_W = torch.linspace(-1.0, 1.0, FEATURES)


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic batch of ``rank`` at ``step``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, FEATURES, generator=g)
    y = x @ TRUE_W + 0.01 * torch.randn(size, generator=g)
    return x, y.unsqueeze(1)


def make_model(seed: int) -> nn.Module:
    """The model, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def param_digest(model: nn.Module) -> str:
    """SHA-256 over the parameters' bytes."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint with the highest step that loads."""
    if not directory.is_dir():
        return None
    found = sorted((p.name, p) for p in directory.iterdir() if CKPT_NAME.match(p.name))
    for _name, path in reversed(found):
        try:
            torch.load(path, weights_only=True)
        except Exception:
            continue
        return path
    return None


def save(directory: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    """Write ``ckpt-<step>.pt`` atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{step:08d}.pt"
    tmp = directory / f".ckpt-{step:08d}.{os.getpid()}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


class _Flags:
    def __init__(self) -> None:
        self.usr1 = False
        self.term = False
        signal.signal(signal.SIGTERM, self._term)

    def _term(self, _signum: int, _frame: FrameType | None) -> None:
        self.term = True


def _client() -> Any:
    try:
        from metalguard import checkpoint as client
    except ImportError:
        return None
    return client.connect()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--checkpoint-dir", default=env.get("MG_CHECKPOINT_DIR") or "checkpoints")
    p.add_argument(
        "--checkpoint-every", type=float, default=float(env.get("MG_CHECKPOINT_EVERY") or 0)
    )
    p.add_argument("--resume", default=env.get("MG_RESUME_FROM") or "none")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train; return the exit status."""
    args = parse_args(argv)
    env = os.environ
    rank, world = int(env.get("MG_RANK") or 0), int(env.get("MG_WORLD_SIZE") or 1)
    addr, port = env.get("MG_MASTER_ADDR") or "127.0.0.1", env.get("MG_MASTER_PORT") or "29500"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    ckpt_dir = Path(args.checkpoint_dir)
    model = make_model(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    resume = newest_checkpoint(ckpt_dir) if args.resume == "auto" else None
    if args.resume not in ("auto", "none"):
        resume = Path(args.resume)
    if resume is not None:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])
        print(f"resumed step={step} path={resume}", flush=True)
    ddp = DistributedDataParallel(model)
    loss_fn = nn.MSELoss()
    flags = _Flags()
    wl = _client()
    if wl is None:
        signal.signal(signal.SIGUSR1, lambda *_: setattr(flags, "usr1", True))
    print(f"start step={step} rank={rank} world={world}", flush=True)
    last_periodic = time.monotonic()
    while step < args.steps:
        x, y = batch(args.seed, step, rank, args.batch)
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        step += 1
        if args.step_seconds:
            time.sleep(args.step_seconds)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step={step} loss={mean_loss.item() / world:.6f}", flush=True)
        if wl is not None:
            wl.report_progress(step)
        asked = flags.usr1 or (wl is not None and wl.checkpoint_requested())
        periodic = args.checkpoint_every > 0 and (
            time.monotonic() - last_periodic >= args.checkpoint_every
        )
        wants = torch.tensor([int(asked), int(periodic), int(flags.term)])
        dist.all_reduce(wants, op=dist.ReduceOp.MAX)  # every rank decides the same
        if wants.any():
            path = ckpt_dir / f"ckpt-{step:08d}.pt"
            if rank == 0:
                path = save(ckpt_dir, step, model, opt)
            dist.barrier()
            flags.usr1 = False
            last_periodic = time.monotonic()
            if wl is not None:
                wl.checkpoint_done(step, str(path))
            print(f"checkpoint step={step} path={path}", flush=True)
        if wants[2]:
            print(f"stopped step={step}", flush=True)
            dist.destroy_process_group()
            return EXIT_STOPPED
    print(f"steps={step}", flush=True)
    print(f"digest={param_digest(model)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
