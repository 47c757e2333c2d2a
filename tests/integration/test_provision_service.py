"""The provisioning service with real parts and no VM (tests/support/harness/provision_env.py):
a real nats-server, the real bmc-proxy in front of Redfish emulators, E's real storage
(qemu-img overlays, qemu-storage-daemon NBD exports), the boot server over HTTP; the
"guest" is the test, posting the ready report once the emulator recorded the network
boot.  After every failure nothing is left orphaned (volumes, exports, claims)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from metalguard.controller.provision import machine
from metalguard.controller.provision.manager import ProvisionError
from metalguard.controller.provision.storage import QemuStorage
from metalguard.proto.provision import InstanceRequest
from metalguard.proto.subjects import Subjects
from tests.support.harness.provision_env import (
    NO_BMC,
    NO_RECORD,
    ProvisionEnv,
    free_port,
    missing_tools,
)
from tests.support.waiting import wait_for_line, wait_until

N1, N2, N3 = "r1.c1.n01", "r1.c1.n02", "r1.c1.n03"
METALGUARD = Path(sys.executable).parent / "metalguard"


def req(
    node: str = "", tenant: str = "acme", volume: str = "", user_data: str = ""
) -> InstanceRequest:
    return InstanceRequest(
        tenant=tenant, image="base", node=node, volume=volume, user_data=user_data
    )


async def deploy(env: ProvisionEnv, node: str, tenant: str = "acme", volume: str = "") -> str:
    """An instance ACTIVE on ``node`` (the guest reports ready); its id."""
    before = env.bmcs[node].pxe_boots()
    inst = await env.service.create(req(node, tenant, volume))
    await env.guest_boot(node, before)
    done = await env.service.wait_for(inst.instance_id, timeout_s=30)
    assert (done.state, done.node) == ("active", node)
    return inst.instance_id


async def no_orphans(env: ProvisionEnv) -> None:
    assert await env.orphans() == []


async def refused(env: ProvisionEnv, status: int, work: object) -> ProvisionError:
    assert asyncio.iscoroutine(work)
    with pytest.raises(ProvisionError) as caught:
        await work
    assert caught.value.status == status, caught.value.message
    return caught.value


async def test_a_request_is_active_only_after_the_ready_report(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    bmc = env.bmcs[N1]
    inst = await svc.create(req(N1, user_data="echo hello"))
    assert inst.state == "deploying"
    assert svc.node_states()[N1] == "deploying"
    # the BMC path: a one-time PXE override, then a power cycle, through the bmc-proxy
    assert bmc.emulator.patches[-1]["Boot"] == {
        "BootSourceOverrideTarget": "Pxe",
        "BootSourceOverrideEnabled": "Once",
    }
    assert bmc.emulator.boots == ["Pxe"]
    assert inst.volume in {v.name for v in await env.storage.list_volumes()}
    assert inst.export in await env.storage.list_exports()

    export = await env.guest_boot(N1, 0, ready=False)
    assert export == inst.export  # the script names the current export
    script = await env.script(N1)
    assert f"nbdroot={env.settings.nbd_host},{env.settings.nbd_port},{inst.export}" in script
    assert (await svc.instance(inst.instance_id)).state == "deploying"  # type: ignore[union-attr]

    async with env.http.get(f"{env.boot_url}/userdata/{inst.instance_id}/{export}") as resp:
        assert (resp.status, await resp.text()) == (200, "echo hello")
    async with env.http.post(f"{env.boot_url}/ready/{inst.instance_id}/wrong-token") as resp:
        assert resp.status == 403
    async with env.http.get(f"{env.boot_url}/userdata/{inst.instance_id}/nope") as resp:
        assert resp.status == 403
    assert (await svc.instance(inst.instance_id)).state == "deploying"  # type: ignore[union-attr]

    url = f"{env.boot_url}/ready/{inst.instance_id}/{export}"
    async with env.http.post(url, json={"boot_id": "b-7", "kernel": "6.1"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["state"] == "active"
    active = await svc.wait_for(inst.instance_id, timeout_s=10)
    assert active.state == "active"
    assert active.ready_report == {"boot_id": "b-7", "kernel": "6.1"}
    assert svc.node_states()[N1] == "active"
    async with env.http.post(url, json={"boot_id": "b-7"}) as resp:
        assert resp.status == 200  # a repeated report: still active
    event = await env.wait_event("instance.active", inst.instance_id)
    assert event.attributes["tenant"] == "acme"
    assert event.attributes["node"] == N1
    assert event.node is not None
    assert event.node.handle == N1
    assert env.kinds(inst.instance_id) == ["instance.deploying", "instance.active"]
    # another node's MAC has no instance: its script falls through
    assert "no instance for this node" in await env.script(N2)
    await no_orphans(env)


async def test_the_boot_files_are_served(provision: ProvisionEnv, tmp_path: Path) -> None:
    env = provision
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"\x7fELF kernel bytes")
    async with env.http.get(f"{env.boot_url}/files/vmlinuz") as resp:
        assert resp.status == 404  # none configured
    env.service.settings = dataclasses.replace(env.service.settings, kernel=str(kernel))
    async with env.http.get(f"{env.boot_url}/files/vmlinuz") as resp:
        assert resp.status == 200
        assert await resp.read() == b"\x7fELF kernel bytes"
    async with env.http.get(f"{env.boot_url}/files/initrd") as resp:
        assert resp.status == 404
    async with env.http.get(f"{env.boot_url}/files/other") as resp:
        assert resp.status == 404


async def test_switch_exports_the_new_volume_and_drops_the_old(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    instance_id = await deploy(env, N1)
    a = await svc.instance(instance_id)
    assert a is not None
    resets = len(env.bmcs[N1].emulator.resets)

    sw = await svc.switch(instance_id, "beta", "base")
    assert (sw.state, sw.tenant, sw.node) == ("switching", "beta", N1)
    assert sw.volume != a.volume
    assert sw.export != a.export
    exports = await env.storage.list_exports()
    assert sw.export in exports
    assert a.export not in exports
    assert len(env.bmcs[N1].emulator.resets) > resets  # power-cycled through the BMC
    export = await env.guest_boot(N1, 1)
    assert export == sw.export
    b = await svc.wait_for(instance_id, timeout_s=10)
    assert (b.state, b.tenant, b.volume) == ("active", "beta", sw.volume)

    volumes = {v.name: v for v in await env.storage.list_volumes()}
    assert volumes[a.volume].tenant == "acme"  # A's volume kept for A
    assert volumes[sw.volume].tenant == "beta"
    assert svc.volume_users() == {sw.volume: instance_id}
    async with env.http.post(f"{env.boot_url}/ready/{instance_id}/{a.export}") as resp:
        assert resp.status == 403  # A's token is dead
    assert env.kinds(instance_id)[-2:] == ["instance.switching", "instance.active"]
    await no_orphans(env)


async def test_release_keeps_or_deletes_the_volume(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    kept = await deploy(env, N1)
    gone = await deploy(env, N2, tenant="beta")
    keep_volume = (await svc.instance(kept)).volume  # type: ignore[union-attr]
    gone_volume = (await svc.instance(gone)).volume  # type: ignore[union-attr]

    done = await svc.release(kept, keep_volume=True)
    assert (done.state, done.export) == ("released", "")
    assert env.bmcs[N1].emulator.resets[-1] == "ForceOff"
    assert env.bmcs[N1].emulator.system["PowerState"] == "Off"
    assert svc.node_states()[N1] == "available"
    assert await svc.release(kept, keep_volume=True) == done  # idempotent

    await svc.release(gone, keep_volume=False)
    names = {v.name for v in await env.storage.list_volumes()}
    assert keep_volume in names
    assert gone_volume not in names
    assert await env.storage.list_exports() == []
    assert env.kinds(kept)[-2:] == ["instance.releasing", "instance.released"]
    await no_orphans(env)

    # the kept volume boots again for its tenant, on another node
    again = await deploy(env, N3, volume=keep_volume)
    assert (await svc.instance(again)).volume == keep_volume  # type: ignore[union-attr]
    await no_orphans(env)


async def test_a_deploy_timeout_retries_elsewhere_then_fails_and_flags(
    provision: ProvisionEnv,
) -> None:
    env, svc = provision, provision.service
    svc.settings = dataclasses.replace(svc.settings, deploy_attempts=2, max_failures=2)
    inst = await svc.create(req())  # names no node: n01 first
    assert inst.node == N1
    env.clock.skipped += 61
    await svc.run_pass()
    await wait_until(
        lambda: env.kinds(inst.instance_id).count("instance.deploying") == 2, 10, "the retry"
    )
    moved = svc.store.instances[inst.instance_id]
    assert (moved.state, moved.node, moved.attempts) == ("deploying", N2, 2)
    assert moved.export != inst.export
    assert "no ready report from r1.c1.n01" in moved.history[-1].reason
    assert inst.export not in await env.storage.list_exports()
    assert moved.export in await env.storage.list_exports()
    assert svc.node_states()[N1] == "available"
    assert svc.store.claims[N1].failures == 1

    env.clock.skipped += 61
    await svc.run_pass()
    failed = await svc.wait_for(inst.instance_id, ("deploy_failed",), timeout_s=10)
    assert failed.export == ""
    assert "no ready report from r1.c1.n02" in failed.error
    assert failed.volume not in {v.name for v in await env.storage.list_volumes()}
    await env.wait_event("instance.deploy_failed", inst.instance_id)
    await no_orphans(env)

    # a second failure on n01 flags it; then it is refused
    pinned = await svc.create(req(N1))
    env.clock.skipped += 61
    await svc.run_pass()
    await svc.wait_for(pinned.instance_id, ("deploy_failed",), timeout_s=10)
    flagged = await env.wait_event("node.provision_flagged")
    assert flagged.attributes == {"node": N1, "failures": 2}
    assert svc.node_states()[N1] == "deploy_failed"
    err = await refused(env, 409, svc.create(req(N1)))
    assert "flagged" in err.message
    await no_orphans(env)
    cleared = await svc.clear_flag(N1)
    assert (cleared.state, cleared.failures, cleared.flagged) == ("available", 0, False)


async def test_only_healthy_uncordoned_nodes(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    await env.isolate(N2)
    err = await refused(env, 409, svc.create(req(N2)))
    assert "FAILING" in err.message
    record = env.nodes.records[N3]
    await env.nodes.put_record(msgspec.structs.replace(record, cordoned=True))
    err = await refused(env, 409, svc.create(req(N3)))
    assert "cordoned" in err.message
    err = await refused(env, 409, svc.create(req(NO_RECORD)))
    assert "no node record" in err.message
    err = await refused(env, 404, svc.create(req("r1.c9.n99")))
    assert "not a provisioned node" in err.message
    picked = await svc.create(req())  # names none: n01, the only healthy free one with a BMC
    assert picked.node == N1
    await no_orphans(env)
    assert svc.node_states()[N2] == "available"


async def test_a_failing_node_marks_its_instance_and_replace_boots_another(
    provision: ProvisionEnv,
) -> None:
    env, svc = provision, provision.service
    instance_id = await deploy(env, N1)
    old = await svc.instance(instance_id)
    assert old is not None
    await env.isolate(N1)  # the real isolation path: node.isolated, FAILING
    await svc.run_pass()
    event = await env.wait_event("instance.node_failing", instance_id)
    assert event.attributes["node"] == N1
    marked = await svc.instance(instance_id)
    assert marked is not None
    assert "replace" in marked.error

    new = await svc.replace(instance_id)
    assert (new.state, new.volume) == ("deploying", old.volume)  # the same volume
    assert new.node not in (N1, "")
    exports = await env.storage.list_exports()
    assert old.export not in exports
    assert new.export in exports
    export = await env.guest_boot(new.node, 0)
    assert export == new.export
    done = await svc.wait_for(instance_id, timeout_s=10)
    assert (done.state, done.node, done.volume) == ("active", new.node, old.volume)
    replaced = await env.wait_event("instance.replaced", instance_id)
    assert replaced.attributes["previous_node"] == N1
    assert svc.node_states()[N1] == "available"
    await wait_until(
        lambda: "ForceOff" in env.bmcs[N1].emulator.resets, 10, "the failed node powered off"
    )
    await no_orphans(env)


async def test_bad_inputs_are_refused_and_leave_nothing(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    err = await refused(env, 404, svc.create(InstanceRequest(tenant="acme", image="nope")))
    assert "no image 'nope'" in err.message
    err = await refused(env, 400, svc.create(req(N1, user_data="a\x00b")))
    assert err.reasons
    assert "NUL" in err.reasons[0]
    await no_orphans(env)

    # no bmc-proxy answers n04's BMC: 504, rolled back
    err = await refused(env, 504, svc.create(req(NO_BMC)))
    assert "no bmc-proxy answers" in err.message
    assert svc.node_states()[NO_BMC] == "available"
    assert await svc.instances() == []
    await no_orphans(env)

    # n03's BMC is down behind its proxy: 502 with the proxy's reason, rolled back
    await env.bmcs[N3].runner.cleanup()
    err = await refused(env, 502, svc.create(req(N3)))
    assert "bmc_pxe_once" in err.message
    assert svc.node_states()[N3] == "available"
    assert await svc.instances() == []
    assert await env.storage.list_volumes() == []
    await no_orphans(env)

    # a node that is not available
    busy = await svc.create(req(N1))
    err = await refused(env, 409, svc.create(req(N1, tenant="beta")))
    assert busy.instance_id in err.message
    await no_orphans(env)

    # two requests for one node at once: exactly one wins
    results = await asyncio.gather(
        svc.create(req(N2, tenant="t1")), svc.create(req(N2, tenant="t2")), return_exceptions=True
    )
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1
    assert len(lost) == 1
    assert isinstance(lost[0], ProvisionError)
    assert lost[0].status == 409
    assert svc.store.claims[N2].instance_id == won[0].instance_id
    await no_orphans(env)


async def test_an_export_that_fails_is_rolled_back(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    instance_id = await deploy(env, N1)
    volume = (await svc.instance(instance_id)).volume  # type: ignore[union-attr]
    await svc.release(instance_id, keep_volume=True)
    # the kept volume's file is damaged: the export daemon cannot open it
    path = env.storage.volumes.path(volume)
    with path.open("r+b") as f:
        f.write(b"\0" * 512)
    boots = env.bmcs[N2].pxe_boots()
    err = await refused(env, 502, svc.create(req(N2, volume=volume)))
    assert "export of volume" in err.message
    assert env.bmcs[N2].pxe_boots() == boots  # the node was never booted
    assert svc.node_states()[N2] == "available"
    assert svc.volume_users() == {}
    assert volume in {v.name for v in await env.storage.list_volumes()}  # the tenant's kept
    assert [i.state for i in await svc.instances()] == ["released"]
    await no_orphans(env)


async def test_a_restarted_controller_resumes_a_deploy_with_its_deadline(
    provision: ProvisionEnv,
) -> None:
    env, first = provision, provision.service
    inst = await first.create(req(N1))
    deadline = machine.deadline(inst, env.settings.deploy_timeout_s)
    await first.stop()
    resets = list(env.bmcs[N1].emulator.resets)
    # leftovers of a crash: a claim of no instance, an export nobody owns
    await first.store.claim(N3, "i-ghost", env.clock())
    await env.storage.create_volume("ghost-vol", "acme", "base")
    await env.storage.export("ghost-vol", "ghost-export-0123456789")
    await first.store.put_volume(
        machine.VolumeEntry(
            volume=next(v for v in await env.storage.list_volumes() if v.name == "ghost-vol"),
            created_by="i-ghost",
        )
    )

    proxy = env.proxy
    assert proxy is not None
    executed = proxy.executed
    second = await env.new_service()
    env.service = second
    await second.start()
    resumed = await second.instance(inst.instance_id)
    assert resumed is not None
    assert resumed.state == "deploying"
    assert machine.deadline(resumed, env.settings.deploy_timeout_s) == deadline
    assert "ghost-export-0123456789" not in await env.storage.list_exports()
    assert inst.export in await env.storage.list_exports()
    assert second.node_states()[N3] == "available"
    await no_orphans(env)
    # the boot is sent again with the same command ids: answered, the BMC not acting twice
    await wait_until(lambda: proxy.executed >= executed + 2, 10, "the boot sent again")
    assert env.bmcs[N1].emulator.resets == resets

    await env.guest_boot(N1, 0)
    done = await second.wait_for(inst.instance_id, timeout_s=10)
    assert done.state == "active"
    await no_orphans(env)


async def test_a_resumed_deploy_past_its_deadline_fails(provision: ProvisionEnv) -> None:
    env, first = provision, provision.service
    inst = await first.create(req(N1))
    await first.stop()
    env.clock.skipped += env.settings.deploy_timeout_s + 1
    second = await env.new_service()
    env.service = second
    await second.start()
    await second.run_pass()
    failed = await second.wait_for(inst.instance_id, ("deploy_failed",), timeout_s=10)
    assert "no ready report" in failed.error
    await no_orphans(env)


async def test_a_switch_whose_bmc_fails_is_rolled_back(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    instance_id = await deploy(env, N3)
    a = await svc.instance(instance_id)
    assert a is not None
    await env.bmcs[N3].runner.cleanup()  # the BMC stops answering its proxy
    err = await refused(env, 502, svc.switch(instance_id, "beta", "base"))
    assert "network boot of r1.c1.n03" in err.message
    back = await svc.instance(instance_id)
    assert back is not None
    assert (back.state, back.tenant, back.volume, back.export) == (
        "active",
        "acme",
        a.volume,
        a.export,
    )
    assert back.history[-1].reason.startswith("rolled back:")
    assert await env.storage.list_exports() == [a.export]  # A still served, B's gone
    assert {v.name for v in await env.storage.list_volumes()} == {a.volume}
    assert "instance.switching" not in env.kinds(instance_id)
    await no_orphans(env)


async def test_a_release_whose_bmc_fails_stays_releasing(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    instance_id = await deploy(env, N3)
    await env.bmcs[N3].runner.cleanup()
    err = await refused(env, 502, svc.release(instance_id, keep_volume=True))
    assert "power-off failed" in err.message
    inst = await svc.instance(instance_id)
    assert inst is not None
    assert inst.state == "releasing"
    assert await env.storage.list_exports() == []  # the tenant is cut off its volume
    assert svc.node_states()[N3] == "releasing"  # not given to anyone meanwhile
    await refused(env, 409, svc.create(req(N3)))
    await no_orphans(env)


async def test_the_agents_first_batch_counts_as_ready(provision: ProvisionEnv) -> None:
    env, svc = provision, provision.service
    inst = await svc.create(req(N2))
    await svc.run_pass()
    assert (await svc.instance(inst.instance_id)).state == "deploying"  # type: ignore[union-attr]
    await env.report(N2)  # the image carries the agent: its batch from the new boot
    await svc.run_pass()
    done = await svc.wait_for(inst.instance_id, timeout_s=10)
    assert (done.state, done.ready_report) == ("active", {"source": "telemetry"})
    await no_orphans(env)


@pytest.mark.skipif(bool(missing_tools()), reason=f"not installed: {missing_tools()}")
async def test_controller_run_serves_the_boot_chain(
    nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    """``metalguard controller run`` with ``[provision] enabled``: the export daemon, the
    service and the boot server start with it and stop cleanly on SIGTERM."""
    boot, nbd = free_port(), free_port()
    data = tmp_path / "data"
    config = tmp_path / "controller.toml"
    config.write_text(
        f'region = "r1"\n[nats]\nservers = ["{nats_url}"]\nprefix = "{subjects.prefix}"\n'
        f'[provision]\nenabled = true\ndata_dir = "{data}"\n'
        f'boot_listen = "127.0.0.1:{boot}"\nnbd_listen = "127.0.0.1:{nbd}"\n'
        f'[[provision.nodes]]\nnode = "r1.c1.n01"\nmac = "52:54:00:00:00:01"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD), "controller", "run", "--config", str(config),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        await wait_for_line(proc.stderr, "running", 30, seen)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{boot}/boot.ipxe") as resp:
                text = await resp.text()
            assert f"chain http://127.0.0.1:{boot}/boot/" in text
            async with http.get(f"http://127.0.0.1:{boot}/boot/52-54-00-00-00-01.ipxe") as resp:
                assert "no instance" in await resp.text()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        leftover = QemuStorage(data, listen_host="127.0.0.1", listen_port=nbd)
        await leftover.start()  # the daemon outlives the controller: adopt and end it
        await leftover.close(stop_daemon=True)
    assert proc.returncode == 0, "".join(seen) + err.decode()
