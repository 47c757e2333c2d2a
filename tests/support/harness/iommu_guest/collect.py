"""The agent's ``iommu`` collector run INSIDE the IOMMU test guest, on the guest's own
/sys and /proc (tests/support/harness/iommu_vm.py, ``inside=True``).

The guest has no Python of its own: its init mounts the host's root read-only at /host
(virtiofs) and runs the host's interpreter on this file through the host's dynamic loader,
with the repository and the virtual environment's site-packages on ``PYTHONPATH``
(nothing is installed in the guest).  It prints one JSON object on stdout, which the init
sends over the data port: ``posture`` (``msgspec.json.encode`` of the
:class:`~metalguard.proto.iommu.IommuPosture`), ``problems`` (the files read_iommu could
not read), ``groups`` (the IOMMU groups it read) and how long the imports and the reading
took (``import_s``, ``run_s``: the guest is emulated, so they are slow).

Usage: ``collect.py [SYSFS [PROCFS]]`` (default ``/sys`` and ``/proc``).
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    started = time.monotonic()
    from pathlib import Path

    import msgspec

    from metalguard.agent.collectors.iommu import read_iommu
    from metalguard.agent.collectors.iommu_parse import assess

    imported = time.monotonic()
    sysfs = Path(argv[1] if len(argv) > 1 else "/sys")
    procfs = Path(argv[2] if len(argv) > 2 else "/proc")
    reading = read_iommu(sysfs, procfs)
    problems = list(reading.problems)
    posture = assess(reading)
    out = {
        "posture": posture,
        "problems": list(problems),
        "groups": {group: list(members) for group, members in reading.group_members.items()},
        "import_s": round(imported - started, 3),
        "run_s": round(time.monotonic() - imported, 3),
    }
    sys.stdout.buffer.write(msgspec.json.encode(out) + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
