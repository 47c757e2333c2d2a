"""``python -m metalguard.demo.sim.nvidia_smi --state DIR --gpu-reset -i N``: the simulated
node's ``nvidia-smi`` (only the reset the agent's ``gpu_reset`` verb runs); exit status 0
when reset, 1 when not, 2 for a usage error (like nvidia-smi)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from metalguard.demo.sim.gpus import reset


def main(argv: list[str] | None = None) -> int:
    """Reset the GPU; the exit status."""
    parser = argparse.ArgumentParser(prog="nvidia-smi (simulated)")
    parser.add_argument("--state", required=True, type=Path, help="the node's nvml directory")
    parser.add_argument("--gpu-reset", action="store_true", required=True)
    parser.add_argument("-i", "--id", dest="index", required=True, type=int)
    args = parser.parse_args(argv)
    ok, said = reset(args.state, args.index)
    print(said, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
