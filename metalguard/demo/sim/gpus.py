"""A simulated node's NVIDIA GPUs as files (docs/simulation.md, "GPUs"): what the
simulated NVML (:mod:`demo.sim.nvml`) answers, what GPU faults change and what the
simulated ``nvidia-smi --gpu-reset`` (:mod:`demo.sim.nvidia_smi`) clears.

Under ``<node dir>/nvml/``: ``state.json`` (each GPU's counters and flags, replaced whole
on every change) and ``xids`` (one ``<gpu index> <xid>`` line per XID, appended; the
simulated NVML's event wait reads what is new).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

NVML_DIR = "nvml"
STATE = "state.json"
XIDS = "xids"
RESETTABLE = ("remap_pending", "ecc_dbe_volatile", "retired_pending")
"""What a GPU reset clears (volatile counts, pending remaps and retirements)."""


def state_dir(node_dir: Path) -> Path:
    """``<node dir>/nvml``."""
    return node_dir / NVML_DIR


def bus_id(pci_address: str) -> str:
    """NVML's form of a sysfs PCI address: ``0000:10:00.0`` -> ``00000000:10:00.0``."""
    domain, _, rest = pci_address.partition(":")
    return f"{domain.rjust(8, '0')}:{rest}"


def new_gpu(index: int, pci_address: str) -> dict[str, Any]:
    """A healthy H100 at ``pci_address``."""
    return {
        "index": index,
        "uuid": f"GPU-sim-{pci_address.replace(':', '-').replace('.', '-')}",
        "name": "NVIDIA H100 80GB HBM3 (simulated)",
        "bus_id": bus_id(pci_address),
        "temperature": 40 + index,
        "power_mw": 70_000 + 1000 * index,
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "remap_pending": 0,
        "remap_failure": 0,
        "retired_pending": 0,
        "resets": 0,
        "reset_fails": False,
    }


def write_state(directory: Path, gpus: list[dict[str, Any]]) -> None:
    """Replace ``state.json`` in one rename (a reader sees the old or the new one)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE
    tmp = path.with_name(f".{STATE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"gpus": gpus}, indent=1))
    os.replace(tmp, path)
    (directory / XIDS).touch()


def read_state(directory: Path) -> list[dict[str, Any]]:
    """Every GPU's state (empty when the node has none)."""
    try:
        doc = json.loads((directory / STATE).read_text())
    except FileNotFoundError:
        return []
    gpus = doc.get("gpus", [])
    return gpus if isinstance(gpus, list) else []


def create(node_dir: Path, pci_addresses: list[str]) -> Path:
    """Write a node's GPUs (healthy) at these PCI addresses; their directory."""
    directory = state_dir(node_dir)
    write_state(directory, [new_gpu(i, a) for i, a in enumerate(pci_addresses)])
    return directory


def change(directory: Path, index: int, **values: Any) -> dict[str, Any]:
    """Set fields of GPU ``index``; its new state (KeyError when there is no such GPU)."""
    gpus = read_state(directory)
    gpu = next((g for g in gpus if g.get("index") == index), None)
    if gpu is None:
        raise KeyError(f"no GPU {index} in {directory}")
    gpu.update(values)
    write_state(directory, gpus)
    return gpu


def raise_xid(directory: Path, index: int, xid: int) -> None:
    """Report XID ``xid`` on GPU ``index`` (appended to ``xids``)."""
    with (directory / XIDS).open("a") as f:
        f.write(f"{index} {xid}\n")


def reset(directory: Path, index: int) -> tuple[bool, str]:
    """What ``nvidia-smi --gpu-reset -i index`` does: (ok, what it prints)."""
    gpus = read_state(directory)
    gpu = next((g for g in gpus if g.get("index") == index), None)
    if gpu is None:
        return False, f"No GPU with index {index} found."
    if gpu.get("reset_fails"):
        return False, f"Unable to reset GPU {gpu['bus_id']}: Unknown Error"
    for key in RESETTABLE:
        gpu[key] = 0
    gpu["resets"] = int(gpu.get("resets", 0)) + 1
    write_state(directory, gpus)
    return True, f"GPU {gpu['bus_id']} was successfully reset."
