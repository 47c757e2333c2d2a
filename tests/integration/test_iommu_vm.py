"""The DMA isolation posture on a real kernel's sysfs (docs/security.md "DMA
isolation"): QEMU q35 guests booted by tests/support/harness/iommu_vm.py, whose /sys and
/proc the harness rebuilds as a tree, and the agent's ``iommu`` collector reading it.

- With the emulated VT-d unit, a PCIe switch whose downstream ports have no ACS: the
  collector's groups are the guest kernel's own; the NICs behind the switch make the
  node ``shared`` (each reason names the port); the GPU behind its root port is alone.
- Each device behind a root port of its own: ``isolated``.
- ``iommu=pt``: identity domains, ``off``; no IOMMU at all: ``off``.
- The same collector run INSIDE each guest, on the guest kernel's real /sys and /proc (the
  host's Python and this repository, shared read-only into the guest with virtiofs: the
  cloud kernel has no 9p), judges exactly what the host judges from the snapshot.

The snapshot itself is a faithful sysfs
tree: a QEMU q35 guest with a root port, a PCIe switch with two e1000e behind its
downstream ports and a display-class "GPU" behind a second root port, booted with an
emulated VT-d unit and without one.  With it, every IOMMU group the guest kernel listed
is in the rebuilt tree, each device linking back to its group; without it, there are no
groups and no IOMMU units.  Each function's config file is all of its config space (4096
bytes for a PCIe function) and agrees with its vendor, device and class files; the
switch's ports sit under the root port as directories, as the kernel nests them.

Skips, with the reason, where QEMU or busybox-static is missing (tests/ensure-tools.sh)
or no Debian cloud kernel can be had (apt; downloaded once: rxe_kernel.cache_root());
the in-guest check alone skips where virtiofsd (qemu-system-common), unshare, the cloud
kernel's virtiofs modules or this Python's files cannot be had.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from metalguard.agent.collectors.iommu import read_iommu
from metalguard.agent.collectors.iommu_parse import assess
from metalguard.proto.iommu import IommuPosture
from tests.support.harness import iommu_vm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("vm")]

PCIE_CAP = 0x10
ROOT_PORT, UPSTREAM, DOWNSTREAM, ENDPOINT = 4, 5, 6, 0
"""Device/port types of the PCI Express capability."""
E1000E = ("0x8086", "0x10d3")


VARIANTS: dict[object, dict[str, object]] = {
    True: {"iommu": True, "inside": True},
    False: {"iommu": False, "inside": True},
    "direct": {
        "iommu": True, "devices": iommu_vm.DIRECT_DEVICES, "name": "direct", "inside": True,
    },
    "passthrough": {
        "iommu": True, "iommu_args": "intel_iommu=on iommu=pt", "name": "pt", "inside": True,
    },
}  # fmt: skip
"""The guests booted (once each, for the module): the switch with and without the
IOMMU, every device behind its own root port, and the IOMMU in passthrough mode.  Each
boot also runs the collector inside the guest (``inside``: a few seconds more)."""


@pytest.fixture(scope="session")  # once per worker: xdist may run other modules between
def snapshots(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[object, iommu_vm.GuestSnapshot]:
    if (reason := iommu_vm.missing()) is not None:
        pytest.skip(f"IOMMU VM: {reason}")
    work = tmp_path_factory.mktemp("iommu-vm")
    out = {}
    for key, how in VARIANTS.items():
        out[key] = snap = iommu_vm.snapshot(work, **how)  # type: ignore[arg-type]
        print(f"IOMMU VM ({key}) ran {snap.wall_s:.1f}s: {snap.timings}")
        if snap.inside_why:
            print(f"IOMMU VM ({key}): no in-guest posture: {snap.inside_why}")
        else:
            print(f"IOMMU VM ({key}) in-guest Python: {snap.inside_timings}")
    return out


def _devices(root: Path) -> dict[str, Path]:
    """Every PCI function of the tree: BDF -> its directory (through sys/bus/pci/devices)."""
    return {link.name: link.resolve() for link in (root / "sys/bus/pci/devices").iterdir()}


def _pcie_type(config: bytes) -> int | None:
    """The PCI Express capability's device/port type (None: a conventional function)."""
    if not config[0x06] & 0x10:  # no capability list
        return None
    pointer, seen = config[0x34] & 0xFC, 0
    while pointer and seen < 48:
        if config[pointer] == PCIE_CAP:
            return (config[pointer + 2] >> 4) & 0xF
        pointer, seen = config[pointer + 1] & 0xFC, seen + 1
    return None


def _hex(path: Path) -> int:
    return int(path.read_text().strip(), 16)


def _check_functions(snap: iommu_vm.GuestSnapshot) -> dict[str, tuple[Path, bytes]]:
    """Each function's config space agrees with its sysfs files; BDF -> (dir, config)."""
    root = snap.root
    out = {}
    for bdf, folder in _devices(root).items():
        assert folder.is_relative_to(root / "sys/devices/pci0000:00"), (bdf, folder)
        assert folder.name == bdf
        config = (folder / "config").read_bytes()
        vendor, device = struct.unpack_from("<HH", config)
        assert vendor == _hex(folder / "vendor"), bdf
        assert device == _hex(folder / "device"), bdf
        assert int.from_bytes(config[9:12], "little") == _hex(folder / "class"), bdf
        expected = 4096 if _pcie_type(config) is not None else 256
        assert len(config) == expected, (bdf, len(config))
        out[bdf] = (folder, config)
    return out


def _check_topology(snap: iommu_vm.GuestSnapshot) -> None:
    """The switch under root port 1, both NICs under its downstream ports, the GPU under
    root port 2: each one's directory inside its parent bridge's."""
    functions = _check_functions(snap)
    kind = {bdf: _pcie_type(config) for bdf, (_, config) in functions.items()}
    by_type = {t: sorted(b for b, k in kind.items() if k == t) for t in set(kind.values())}
    assert len(by_type[ROOT_PORT]) == 2, kind
    assert len(by_type[UPSTREAM]) == 1, kind
    assert len(by_type[DOWNSTREAM]) == 2, kind
    upstream = functions[by_type[UPSTREAM][0]][0]
    assert upstream.parent.name in by_type[ROOT_PORT]
    assert upstream.parent.parent.name == "pci0000:00"
    nics = []
    for down in by_type[DOWNSTREAM]:
        folder = functions[down][0]
        assert folder.parent == upstream, (down, folder)
        children = [bdf for bdf, (f, _) in functions.items() if f.parent == folder]
        assert len(children) == 1, (down, children)
        child = functions[children[0]][0]
        ids = ((child / "vendor").read_text().strip(), (child / "device").read_text().strip())
        assert ids == E1000E, (children[0], ids)
        assert kind[children[0]] == ENDPOINT
        nics.append(children[0])
    assert len(set(nics)) == 2
    gpus = [b for b, (f, _) in functions.items() if (f / "class").read_text().startswith("0x0300")]
    assert len(gpus) == 1, gpus
    gpu = functions[gpus[0]][0]
    assert gpu.parent.name in by_type[ROOT_PORT]
    assert gpu.parent != upstream.parent
    assert len(functions[gpus[0]][1]) == 4096


def test_with_the_iommu_every_group_is_in_the_tree(
    snapshots: dict[object, iommu_vm.GuestSnapshot],
) -> None:
    snap = snapshots[True]
    root = snap.root
    assert "intel_iommu=on" in snap.cmdline.split()
    assert (root / "proc/cmdline").read_text().strip() == snap.cmdline
    assert "DMAR: IOMMU enabled" in snap.dmesg_iommu, snap.dmesg_iommu
    units = sorted(p.name for p in (root / "sys/class/iommu").iterdir())
    assert units == ["dmar0"], units
    assert (root / "sys/class/iommu/dmar0").is_dir()

    assert snap.groups, snap.dmesg_iommu
    devices = _devices(root)
    grouped: dict[str, str] = {}
    for group, members in snap.groups.items():
        folder = root / "sys/kernel/iommu_groups" / group
        assert sorted(p.name for p in (folder / "devices").iterdir()) == list(members)
        assert (folder / "type").read_text().strip() in ("DMA", "DMA-FQ"), group  # iommu=nopt
        for bdf in members:
            assert bdf not in grouped, f"{bdf} in groups {grouped[bdf]} and {group}"
            grouped[bdf] = group
            assert bdf in devices, bdf
            assert (folder / "devices" / bdf).resolve() == devices[bdf]
            link = devices[bdf] / "iommu_group"
            assert link.is_symlink(), bdf
            assert not link.readlink().is_absolute(), (bdf, link.readlink())
            assert link.resolve() == folder.resolve(), (bdf, link.readlink())
    assert sorted(grouped) == sorted(devices)  # every function is in a group
    listed = sorted(p.name for p in (root / "sys/kernel/iommu_groups").iterdir())
    assert listed == sorted(snap.groups)
    _check_topology(snap)


def test_without_the_iommu_there_are_no_groups(
    snapshots: dict[object, iommu_vm.GuestSnapshot],
) -> None:
    snap = snapshots[False]
    root = snap.root
    assert "intel_iommu=on" not in snap.cmdline.split()
    assert "DMAR: IOMMU enabled" not in snap.dmesg_iommu
    assert snap.groups == {}
    assert not any((root / "sys/class/iommu").glob("*"))
    assert not any((root / "sys/kernel/iommu_groups").glob("*"))
    for bdf, folder in _devices(root).items():
        assert not (folder / "iommu_group").is_symlink(), bdf
    _check_topology(snap)


# --- the collector on the guests' trees -----------------------------------------------


def _posture(snap: iommu_vm.GuestSnapshot) -> IommuPosture:
    reading = read_iommu(snap.root / "sys", snap.root / "proc")
    problems = list(reading.problems)
    assert problems == []
    # the groups the collector read are the guest kernel's own
    assert dict(reading.group_members) == snap.groups
    return assess(reading)


def test_behind_a_switch_without_acs_the_nics_make_the_node_shared(
    snapshots: dict[object, iommu_vm.GuestSnapshot],
) -> None:
    posture = _posture(snapshots[True])
    assert posture.posture == "shared", posture.reasons
    assert (posture.mode, posture.iommus) == ("dma-fq", ("dmar0",))
    assert posture.cmdline == ("intel_iommu=on", "iommu=nopt")
    by_kind = {d.kind: [x for x in posture.devices if x.kind == d.kind] for d in posture.devices}
    assert len(by_kind["nic"]) == 2
    assert len(by_kind["gpu"]) == 1
    for nic in by_kind["nic"]:
        ports = [b.port for b in nic.path]
        assert ports == ["root", "upstream", "downstream"], ports
        downstream = nic.path[-1]
        assert downstream.acs_cap is None  # QEMU 7.2's xio3130: no ACS
        root = nic.path[0]
        assert root.acs_ctl == ("SV", "RR", "CR", "UF")  # the kernel enabled them
        assert f"switch port {downstream.address} above it has no ACS" in " ".join(posture.reasons)
    (gpu,) = by_kind["gpu"]
    assert gpu.peers == ()
    assert [b.port for b in gpu.path] == ["root"]
    assert not any(gpu.address in r for r in posture.reasons)


def test_every_device_behind_its_own_root_port_is_isolated(
    snapshots: dict[object, iommu_vm.GuestSnapshot],
) -> None:
    posture = _posture(snapshots["direct"])
    assert posture.posture == "isolated", posture.reasons
    assert posture.reasons == ()
    assert sorted(d.kind for d in posture.devices) == ["gpu", "nic", "nic"]
    groups = [d.group for d in posture.devices]
    assert len(set(groups)) == 3  # one each


def test_passthrough_and_no_iommu_are_off(
    snapshots: dict[object, iommu_vm.GuestSnapshot],
) -> None:
    pt = _posture(snapshots["passthrough"])
    assert pt.posture == "off", pt.reasons
    assert pt.mode == "identity"
    assert any("iommu=pt" in r for r in pt.reasons)
    assert {d.domain for d in pt.devices} == {"identity"}
    none = _posture(snapshots[False])
    assert none.posture == "off"
    assert none.mode == "off"
    assert none.reasons[0].startswith("no IOMMU")


# --- the collector INSIDE the guest, on its real /sys and /proc ----------------------


@pytest.mark.parametrize("key", list(VARIANTS), ids=[str(k) for k in VARIANTS])
def test_inside_the_guest_the_collector_sees_what_the_snapshot_shows(
    snapshots: dict[object, iommu_vm.GuestSnapshot], key: object
) -> None:
    """The host's Python, run in the guest over virtiofs on the guest kernel's own sysfs
    and procfs (iommu_guest/collect.py), judges the same posture as the host does from the
    snapshot rebuilt out of the same boot."""
    snap = snapshots[key]
    if snap.inside is None:
        if snap.inside_why.startswith("skip:"):
            print(f"IOMMU VM ({key}): {snap.inside_why}")
            pytest.skip(f"IOMMU VM ({key}) in-guest collector: {snap.inside_why}")
        pytest.fail(f"IOMMU VM ({key}): {snap.inside_why}\n{snap.console[-2000:]}")
    assert snap.inside_problems == ()
    assert snap.inside_groups == snap.groups
    host = _posture(snap)
    inside = snap.inside
    assert inside.posture == host.posture, (inside.reasons, host.reasons)
    assert inside.mode == host.mode
    assert inside.reasons == host.reasons
    assert inside.devices == host.devices
    assert inside == host  # iommus, cmdline and the number of groups too
    # the share the run came through: one more function on the root bus, no GPU or NIC,
    # a group of its own with the IOMMU; every tested device where it was
    fs = [
        bdf
        for bdf, folder in _devices(snap.root).items()
        if (folder / "vendor").read_text().strip() == "0x1af4"
        and (folder / "class").read_text().strip().startswith("0x01")
    ]
    assert len(fs) == 1, fs
    assert fs[0].startswith("0000:00:"), fs
    assert all(d.address != fs[0] for d in host.devices)
    if snap.groups:
        (alone,) = (m for m in snap.groups.values() if fs[0] in m)
        assert alone == (fs[0],)
