"""The provisioning API's and CLI's pure parts (controller/api/provision.py,
controller/cli/provision.py): an instance is shown without its secret, the answers are
their documented shapes and follow proto's fields, the statuses, the query flags, the
errors; the CLI's sizes and its --wait loop; the simulated storage's rules (the demo's)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import msgspec
import pytest

from metalguard.controller.api.errors import ApiError
from metalguard.controller.api.provision import (
    answer_status,
    error_of,
    flag,
    instance_answer,
    node_answer,
    node_lines,
    volume_line,
)
from metalguard.controller.api.shapes import (
    InstanceAnswer,
    NodeProvision,
    ProvisionNodeLine,
    VolumeLine,
)
from metalguard.controller.cli.provision import describe, follow, human_bytes, line, parse_size
from metalguard.controller.provision.manager import ProvisionError, ProvisionNode
from metalguard.controller.provision.storage import StorageError
from metalguard.demo.sim.provision import SimStorage, parse_boot_script, sim_mac
from metalguard.proto.provision import Instance, InstanceTransition, Volume

SECRET = "s3cr3t-export-name-0123456789"


def instance(**changes: object) -> Instance:
    base = Instance(
        instance_id="i-1",
        tenant="acme",
        image="base",
        volume="acme-i-1",
        state="active",
        node="r1.c1.n01",
        user_data="echo hi\n",
        ready_ts=10.0,
        ready_report={"kernel": "6.1"},
        created_ts=1.0,
        updated_ts=10.0,
        history=(InstanceTransition(ts=1.0, state="deploying", node="r1.c1.n01"),),
        export=SECRET,
    )
    return msgspec.structs.replace(base, **changes)


def test_an_instance_is_shown_without_its_export_nor_its_user_data() -> None:
    body = instance_answer(instance())
    assert SECRET not in repr(body)
    assert "export" not in body
    assert "user_data" not in body
    assert body["user_data_bytes"] == len(b"echo hi\n")
    assert msgspec.to_builtins(msgspec.convert(body, InstanceAnswer)) == body


def test_the_instance_answer_follows_protos_fields() -> None:
    """A field added to proto's Instance must be shown (or deliberately hidden) here."""
    shown = set(InstanceAnswer.__struct_fields__)
    stored = set(Instance.__struct_fields__) - {"v"}
    assert shown == stored - {"export", "user_data"} | {"user_data_bytes"}


def test_a_provisioned_nodes_answer_is_the_services_record() -> None:
    assert set(ProvisionNodeLine.__struct_fields__) == set(ProvisionNode.__struct_fields__)
    node = ProvisionNode(node="r1.c1.n01", mac="52:54:00:00:00:01", state="active", tenant="a")
    body = node_answer(node)
    assert body["mac"] == "52:54:00:00:00:01"
    assert msgspec.to_builtins(msgspec.convert(body, ProvisionNodeLine)) == body


def test_the_node_lines_carry_state_tenant_and_flag() -> None:
    nodes = [
        ProvisionNode(node="r1.c1.n01", mac="m1", state="active", instance_id="i-1", tenant="a"),
        ProvisionNode(node="r1.c1.n02", mac="m2", state="available", failures=3, flagged=True),
    ]
    lines = node_lines(nodes)
    assert lines["r1.c1.n01"] == {
        "state": "active",
        "instance": "i-1",
        "tenant": "a",
        "image": None,
        "flagged": False,
    }
    assert lines["r1.c1.n02"]["flagged"] is True
    assert lines["r1.c1.n02"]["tenant"] is None
    for body in lines.values():
        assert msgspec.to_builtins(msgspec.convert(body, NodeProvision)) == body


def test_a_volume_line_names_its_user() -> None:
    volume = Volume(name="v", tenant="a", image="base", size_bytes=196_608)
    assert volume_line(volume, "i-1")["instance"] == "i-1"
    body = volume_line(volume, "")
    assert body["instance"] is None
    assert msgspec.to_builtins(msgspec.convert(body, VolumeLine)) == body


@pytest.mark.parametrize(
    ("state", "created", "status"),
    [
        ("deploying", True, 202),
        ("active", True, 201),
        ("deploy_failed", True, 201),
        ("switching", False, 202),
        ("releasing", False, 202),
        ("released", False, 200),
        ("active", False, 200),
    ],
)
def test_the_status_says_whether_the_instance_moves_on(
    state: str, created: bool, status: int
) -> None:
    assert answer_status(state, created=created) == status


def test_flags() -> None:
    assert flag(None, "wait", default=False) is False
    assert flag("", "keep_volume", default=True) is True
    assert flag("TRUE", "wait", default=False) is True
    assert flag("no", "keep_volume", default=True) is False
    with pytest.raises(ApiError) as bad:
        flag("maybe", "keep_volume", default=True)
    assert bad.value.status == 400
    assert "keep_volume" in bad.value.message


def test_a_provision_error_keeps_its_status_message_and_reasons() -> None:
    err = error_of(ProvisionError(400, "a; b", reasons=["a", "b"]))
    assert (err.status, err.code, err.reasons) == (400, "bad_request", ["a", "b"])
    bmc = error_of(ProvisionError(502, "bmc_power_cycle to r1.c1.n01: refused"))
    assert (bmc.status, bmc.code) == (502, "bad_gateway")
    assert bmc.reasons is None
    follower = error_of(ProvisionError(503, "ask the leader", "not_leader"))
    assert follower.code == "not_leader"
    assert error_of(ProvisionError(200, "odd")).status == 400


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("256M", 256 << 20), ("2G", 2 << 30), ("1GiB", 1 << 30), ("8k", 8192)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_size_that_is_none_is_a_usage_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("big")


def test_human_bytes() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(196_608) == "192.0 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"
    assert human_bytes(None) == "-"


def test_follow_polls_until_settled_and_tells_each_new_state() -> None:
    answers = iter([{"state": "deploying"}, {"state": "active"}])
    seen: list[str] = []
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    body = follow(
        lambda: next(answers),
        {"state": "deploying"},
        60.0,
        progress=lambda b: seen.append(b["state"]),
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert body == {"state": "active"}
    assert seen == ["active"]


def test_follow_gives_up_at_its_timeout() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    body = follow(
        lambda: {"state": "deploying"},
        {"state": "deploying"},
        2.0,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert body["state"] == "deploying"
    assert now[0] >= 2.0


def test_the_cli_shows_an_instance_with_its_history() -> None:
    body = instance_answer(instance(error=""))
    assert line(body).startswith("i-1: active (tenant acme, image base, node r1.c1.n01")
    text = describe(body)
    assert "ready report:" in text
    assert "8 bytes" in text
    assert "history:" in text


def test_the_simulated_node_reads_its_boot_from_the_script() -> None:
    script = (
        "#!ipxe\nkernel http://b/files/vmlinuz console=ttyS0 nbdroot=10.0.2.101,10809,"
        f"{SECRET} root=/dev/nbd0 rw mg.instance=i-1 mg.ready=http://b/ready/i-1/{SECRET} "
        f"mg.userdata=http://b/userdata/i-1/{SECRET}\ninitrd http://b/files/initrd\nboot\n"
    )
    boot = parse_boot_script(script)
    assert boot is not None
    assert boot.nbd_export == SECRET
    assert boot.instance == "i-1"
    assert boot.ready_url == f"http://b/ready/i-1/{SECRET}"
    none = "#!ipxe\necho metalguard: no instance for this node\nexit 1\n"
    assert parse_boot_script(none) is None
    assert sim_mac(1) == "52:54:00:6d:00:01"


def test_the_simulated_storage_keeps_the_real_ones_rules(tmp_path: Path) -> None:
    upload = tmp_path / "base.raw"
    upload.write_bytes(b"\0" * 512)

    async def run() -> None:
        storage = SimStorage()
        with pytest.raises(StorageError) as no_image:
            await storage.create_volume("v1", "a", "base")
        assert no_image.value.status == 404
        image = await storage.images.add_file("base", upload)
        assert image.source == "upload:base.raw"
        volume = await storage.create_volume("v1", "a", "base")
        assert volume.size_bytes < 1 << 20  # "copy-on-write": kilobytes
        with pytest.raises(StorageError) as twice:
            await storage.create_volume("v1", "a", "base")
        assert twice.value.status == 409
        with pytest.raises(StorageError) as short:
            await storage.export("v1", "short")
        assert short.value.status == 400
        await storage.export("v1", SECRET)
        await storage.export("v1", SECRET)  # idempotent
        with pytest.raises(StorageError) as second:
            await storage.export("v1", SECRET + "x")
        assert second.value.status == 409  # one export per volume
        with pytest.raises(StorageError) as exported:
            await storage.delete_volume("v1")
        assert exported.value.status == 409
        with pytest.raises(StorageError) as in_use:
            await storage.images.delete("base")
        assert in_use.value.status == 409
        assert storage.attach(SECRET) == "v1"
        assert storage.attach("wrong-name-0123456789") is None
        await storage.unexport(SECRET)
        await storage.unexport(SECRET)
        await storage.delete_volume("v1")
        assert await storage.list_volumes() == []

    asyncio.run(run())
