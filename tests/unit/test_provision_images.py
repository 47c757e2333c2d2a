"""The storage's pure helpers: qemu-img's JSON, upload checks, names, command lines, and
the NBD export plan and gate decisions (controller/provision/qemuimg.py, nbdplan.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metalguard.controller.provision import nbdplan, qemuimg
from metalguard.controller.provision.images import directory_allowed
from metalguard.controller.provision.nbdplan import DaemonExport

QCOW2_INFO = {
    "virtual-size": 33554432,
    "filename": "base.qcow2",
    "cluster-size": 65536,
    "format": "qcow2",
    "actual-size": 720896,
    "format-specific": {
        "type": "qcow2",
        "data": {
            "compat": "1.1",
            "compression-type": "zlib",
            "lazy-refcounts": False,
            "refcount-bits": 16,
            "corrupt": False,
            "extended-l2": False,
        },
    },
    "dirty-flag": False,
}
OVERLAY_INFO = {
    **QCOW2_INFO,
    "backing-filename": "../images/base.qcow2",
    "full-backing-filename": "/data/images/base.qcow2",
    "backing-filename-format": "qcow2",
}
RAW_INFO = {
    "virtual-size": 1048576,
    "filename": "disk.raw",
    "format": "raw",
    "actual-size": 4096,
    "dirty-flag": False,
}


def test_parse_info_of_a_qcow2_base() -> None:
    info = qemuimg.parse_info(json.dumps(QCOW2_INFO))
    assert info == qemuimg.ImageInfo(
        format="qcow2", virtual_size=33554432, actual_size=720896, cluster_size=65536
    )
    qemuimg.check_upload(info, "qcow2", 720896)


def test_parse_info_of_an_overlay_and_of_a_backing_chain() -> None:
    info = qemuimg.parse_info(json.dumps(OVERLAY_INFO).encode())
    assert (info.backing_file, info.backing_format) == ("../images/base.qcow2", "qcow2")
    chain = qemuimg.parse_info(json.dumps([OVERLAY_INFO, QCOW2_INFO]))
    assert chain == info


def test_parse_info_of_raw() -> None:
    info = qemuimg.parse_info(json.dumps(RAW_INFO))
    assert (info.format, info.virtual_size, info.backing_file) == ("raw", 1048576, "")
    qemuimg.check_upload(info, "raw", 1048576)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[]", "expected a JSON object"),
        ('"x"', "expected a JSON object"),
        ('{"virtual-size": 1}', "no 'format'"),
        ('{"format": "raw"}', "'virtual-size' is not a non-negative integer"),
        ('{"format": "raw", "virtual-size": -1}', "non-negative"),
        ('{"format": "raw", "virtual-size": true}', "non-negative"),
    ],
)
def test_parse_info_refuses_bad_json(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        qemuimg.parse_info(text)


def test_check_upload_lists_every_reason() -> None:
    bad = {
        **OVERLAY_INFO,
        "encrypted": True,
        "virtual-size": 0,
        "format-specific": {"type": "qcow2", "data": {"corrupt": True, "data-file": "/etc/x"}},
    }
    with pytest.raises(ValueError, match="not a usable base image") as exc:
        qemuimg.check_upload(qemuimg.parse_info(json.dumps(bad)), "qcow2", 100)
    message = str(exc.value)
    for reason in (
        "backing file ('../images/base.qcow2')",
        "external data file ('/etc/x')",
        "encrypted",
        "marks it corrupt",
        "virtual size 0",
    ):
        assert reason in message


def test_check_upload_format_and_raw_sectors() -> None:
    raw = qemuimg.parse_info(json.dumps({**RAW_INFO, "virtual-size": 512}))
    with pytest.raises(ValueError, match="size 11 is not a multiple of 512"):
        qemuimg.check_upload(raw, "raw", 11)
    with pytest.raises(ValueError, match="reads it as raw, expected qcow2"):
        qemuimg.check_upload(raw, "qcow2", 512)


def test_parse_check() -> None:
    clean = {"image-end-offset": 262144, "total-clusters": 512, "check-errors": 0}
    assert qemuimg.parse_check(json.dumps(clean)) == (0, 0)
    broken = {**clean, "corruptions": 3, "check-errors": 1, "leaks": 2}
    assert qemuimg.parse_check(json.dumps(broken)) == (3, 1)
    with pytest.raises(ValueError, match="not JSON"):
        qemuimg.parse_check("qemu-img: oops")


def test_sniff_format_never_trusts_anything_but_the_qcow2_magic() -> None:
    assert qemuimg.sniff_format(b"QFI\xfb\x00\x00\x00\x03") == "qcow2"
    assert qemuimg.sniff_format(b"KDMV") == "raw"  # a vmdk is opened as raw bytes
    assert qemuimg.sniff_format(b"") == "raw"


@pytest.mark.parametrize("name", ["base", "ubuntu-22.04", "a", "x" * 64, "A_b.c-d"])
def test_good_image_names(name: str) -> None:
    assert qemuimg.check_name("image", name, qemuimg.IMAGE_NAME) == name


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "a/b", "../x", "x" * 65, "a b", "é"])
def test_bad_image_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid image name"):
        qemuimg.check_name("image", name, qemuimg.IMAGE_NAME)


def test_tenant_names_have_no_dots() -> None:
    with pytest.raises(ValueError, match="invalid tenant name"):
        qemuimg.check_name("tenant", "a.b", qemuimg.TENANT_NAME)
    assert qemuimg.check_name("volume", "a.b", qemuimg.VOLUME_NAME) == "a.b"


def test_dir_sizes() -> None:
    assert qemuimg.check_dir_size(32 * 1024 * 1024) == 32 * 1024 * 1024
    assert qemuimg.check_dir_size(5 * 1024 * 1024 + 1) == 6 * 1024 * 1024
    for bad, message in ((1024, "too small"), (2**60, "over the limit"), (True, "integer")):
        with pytest.raises(ValueError, match=message):
            qemuimg.check_dir_size(bad)


def test_command_lines() -> None:
    assert qemuimg.overlay_argv("../images/b.qcow2", "/d/v.qcow2") == [
        "qemu-img", "create", "-q", "-f", "qcow2", "-b", "../images/b.qcow2", "-F", "qcow2",
        "/d/v.qcow2",
    ]  # fmt: skip
    assert qemuimg.convert_argv("/u/x", "raw", "/d/y") == [
        "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", "/u/x", "/d/y",
    ]  # fmt: skip
    assert qemuimg.info_argv("/v", "qcow2", force_share=True)[:3] == ["qemu-img", "info", "-U"]
    argv = qemuimg.mke2fs_argv("/d/f.raw", "/src", "a-very-long-image-name")
    assert argv[argv.index("-L") + 1] == "a-very-long-imag"  # ext4 labels: 16 bytes
    assert argv[-3:] == ["-d", "/src", "/d/f.raw"]


# the NBD export plan ---------------------------------------------------------------

A = "tenantA-export-secret-0001"
B = "tenantB-export-secret-0002"


def test_export_names_and_ids() -> None:
    assert nbdplan.check_export_name(A) == A
    for bad in ("short", "x" * 129, "has space in it!!", "slash/in/the/name/x"):
        with pytest.raises(ValueError, match="invalid export name"):
            nbdplan.check_export_name(bad)
    assert nbdplan.name_of_id(nbdplan.export_id(A)) == A
    assert nbdplan.name_of_id("foreign") is None
    node = nbdplan.node_name(A)
    assert node.startswith("mgv-")
    assert len(node) <= 31
    assert node != nbdplan.node_name(B)


def test_qmp_arguments() -> None:
    add = nbdplan.blockdev_add_args(A, "/d/volumes/v.qcow2")
    assert add["driver"] == "qcow2"
    assert add["file"]["filename"] == "/d/volumes/v.qcow2"
    assert "read-only" not in add  # the overlay is writable, its backing qemu opens read-only
    exp = nbdplan.export_add_args(A)
    assert exp == {
        "type": "nbd",
        "id": "mg-" + A,
        "node-name": nbdplan.node_name(A),
        "name": A,
        "writable": True,
    }
    assert nbdplan.export_del_args(A) == {"id": "mg-" + A, "mode": "hard"}


def test_parse_daemon_replies() -> None:
    reply = [{"id": "mg-" + A, "type": "nbd", "node-name": "mgv-1", "shutting-down": False}]
    assert nbdplan.parse_exports(reply) == [DaemonExport("mg-" + A, "mgv-1")]
    with pytest.raises(ValueError, match="expected a list"):
        nbdplan.parse_exports({"id": "x"})
    with pytest.raises(ValueError, match="bad entry"):
        nbdplan.parse_exports([{"node-name": "x"}])
    nodes = [{"node-name": "mgv-1", "file": "/v.qcow2"}, {"node-name": "#block1", "file": "/v"}]
    assert nbdplan.parse_nodes(nodes) == {"mgv-1": "/v.qcow2", "#block1": "/v"}


def _served(name: str, path: str) -> tuple[DaemonExport, dict[str, str]]:
    node = nbdplan.node_name(name)
    return DaemonExport(nbdplan.export_id(name), node), {node: path}


def test_plan_keeps_adds_and_removes() -> None:
    exp_a, nodes_a = _served(A, "/v/a.qcow2")
    exp_b, nodes_b = _served(B, "/v/b.qcow2")
    nodes = {**nodes_a, **nodes_b, "mgv-orphan": "/v/c.qcow2", "#block9": "/v/a.qcow2"}
    foreign = DaemonExport("someone-else", "n0")
    plan = nbdplan.plan(
        [exp_a, exp_b, foreign], nodes, {A: "/v/a.qcow2", "new-export-name-0003": "/v/n.qcow2"}
    )
    assert plan.keep == (A,)
    assert plan.remove_exports == ("mg-" + B, "someone-else")
    assert plan.remove_nodes == tuple(sorted([nbdplan.node_name(B), "mgv-orphan"]))
    assert plan.add == (("new-export-name-0003", "/v/n.qcow2"),)


def test_plan_replaces_an_export_over_another_file_and_waits_for_shutting_down() -> None:
    exp_a, nodes_a = _served(A, "/v/old.qcow2")
    plan = nbdplan.plan([exp_a], nodes_a, {A: "/v/new.qcow2"})
    assert plan.remove_exports == ("mg-" + A,)
    assert plan.remove_nodes == (nbdplan.node_name(A),)
    assert plan.add == ((A, "/v/new.qcow2"),)
    going = DaemonExport("mg-" + B, nbdplan.node_name(B), shutting_down=True)
    assert nbdplan.plan([going], {}, {}).remove_exports == ()
    assert nbdplan.plan([], {}, {}) == nbdplan.Plan()


def test_gate_decisions() -> None:
    assert nbdplan.gate_refusal(nbdplan.NBD_OPT_LIST) is not None
    assert nbdplan.gate_refusal(nbdplan.NBD_OPT_STARTTLS) is not None
    for option in (nbdplan.NBD_OPT_GO, nbdplan.NBD_OPT_EXPORT_NAME, nbdplan.NBD_OPT_ABORT, 6):
        assert nbdplan.gate_refusal(option) is None
    assert nbdplan.reply_is_final(nbdplan.NBD_REP_ACK)
    assert nbdplan.reply_is_final(nbdplan.NBD_REP_ERR_POLICY)
    assert not nbdplan.reply_is_final(3)  # NBD_REP_INFO: more follow
    assert nbdplan.starts_transmission(nbdplan.NBD_OPT_GO, nbdplan.NBD_REP_ACK)
    assert not nbdplan.starts_transmission(nbdplan.NBD_OPT_GO, nbdplan.NBD_REP_ERR_POLICY)
    assert nbdplan.starts_transmission(nbdplan.NBD_OPT_EXPORT_NAME, 0)
    assert not nbdplan.starts_transmission(6, nbdplan.NBD_REP_ACK)  # NBD_OPT_INFO


def test_image_source_dirs_bound_where_images_are_built_from(tmp_path: Path) -> None:
    inside = tmp_path / "images" / "base"
    inside.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    escape = tmp_path / "images" / "escape"
    escape.symlink_to(tmp_path / "elsewhere")
    roots = [str(tmp_path / "images")]
    assert directory_allowed(inside, roots)
    assert directory_allowed(tmp_path / "images", roots)
    assert not directory_allowed(tmp_path / "elsewhere", roots)
    assert not directory_allowed(escape, roots)  # a symlink out is refused
    assert not directory_allowed(tmp_path / "images-2", roots)  # a prefix is not below
    assert directory_allowed(tmp_path / "elsewhere", [])  # unset: anywhere
