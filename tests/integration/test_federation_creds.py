"""``metalguard creds federate``: two regions' credentials as two accounts of one
supercluster (two nats-servers joined by a gateway, docs/federation.md): each region's
controller has JetStream of its own, the federation subjects cross between the accounts,
and a node still speaks only for itself."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.harness.supercluster import RegionServer
from tests.support.waiting import wait_for_value, wait_until

METALGUARD = Path(sys.executable).parent / "metalguard"
DEADLINE_S = 60.0


def creds(*args: str) -> str:
    done = subprocess.run(
        [str(METALGUARD), "creds", *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def supercluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fedcreds")
    for region in ("r1", "r2"):
        creds("init", "--dir", str(root / region), "--controller", "ctl")
        creds("add-node", "--dir", str(root / region), "--node", f"{region}.c1.a")
    creds("add-node", "--dir", str(root / "r1"), "--node", "r1.c1.b")
    out = root / "accounts.conf"
    creds("federate", "--region", f"r1={root / 'r1'}", "--region", f"r2={root / 'r2'}",
          "--out", str(out))  # fmt: skip
    text = out.read_text()
    servers = [RegionServer(r, root, accounts=text) for r in ("r1", "r2")]
    try:
        for s in servers:
            s.start(servers)
        yield {"root": root, "servers": {s.region: s for s in servers}}
    finally:
        for s in servers:
            s.stop()


async def connect(
    sc: dict[str, Any], region: str, kind: str, name: str, errors: list[str]
) -> Client:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    options: dict[str, Any] = {"nkeys_seed": str(sc["root"] / region / kind / f"{name}.nk")}
    if kind == "nodes":
        options["inbox_prefix"] = f"_INBOX_MG.{name}"
    server = sc["servers"][region]
    return await nats.connect(
        f"nats://127.0.0.1:{server.client_port}", connect_timeout=5, max_reconnect_attempts=2,
        error_cb=on_error, **options,
    )  # fmt: skip


async def test_regions_federate_across_accounts_and_nodes_stay_confined(
    supercluster: dict[str, Any],
) -> None:
    errors: list[str] = []
    ctl1 = await connect(supercluster, "r1", "controllers", "ctl", errors)
    ctl2 = await connect(supercluster, "r2", "controllers", "ctl", errors)
    node_a = await connect(supercluster, "r1", "nodes", "r1.c1.a", errors)
    try:
        # Each region's account has its own JetStream (the meta leader needs a moment).
        for nc in (ctl1, ctl2):
            js = nc.jetstream(timeout=2)

            async def ready(js: Any = js) -> bool:
                try:
                    await js.account_info()
                except Exception:  # 503 until the supercluster's meta leader is elected
                    return False
                return True

            await wait_for_value(ready, bool, DEADLINE_S, "JetStream in the region's account")

        # r2's summary reaches r1's controller; r1 asks r2 a lookup (service import).
        summaries: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_summary(msg: Msg) -> None:
            await summaries.put(msg)

        await ctl1.subscribe("mg.fed.summary.*", cb=on_summary)

        async def answer(msg: Msg) -> None:
            await msg.respond(b"r2 answers")

        await ctl2.subscribe("mg.fed.lookup.r2", cb=answer)
        await ctl1.flush()
        await ctl2.flush()

        async def crossed() -> bool:
            await ctl2.publish("mg.fed.summary.r2", b"summary of r2")
            try:
                msg = await asyncio.wait_for(summaries.get(), 0.5)
            except TimeoutError:
                return False
            return msg.subject == "mg.fed.summary.r2"

        await wait_for_value(crossed, bool, DEADLINE_S, "r2's summary to reach r1")
        reply = await ctl1.request("mg.fed.lookup.r2", b"?", timeout=5)
        assert reply.data == b"r2 answers"

        # Region accounts do not share anything else: r2's telemetry is not r1's.
        seen: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_tel(msg: Msg) -> None:
            await seen.put(msg)

        await ctl1.subscribe("mg.tel.>", cb=on_tel)
        await ctl1.flush()
        await ctl2.publish("mg.tel.r2.c1.a", b"r2 controller test")  # denied to a controller
        # A node speaks only for itself, also inside a federated account.
        await node_a.publish("mg.tel.r1.c1.b", b"forged")
        await node_a.publish("mg.fed.summary.r1", b"forged summary")
        await node_a.flush()

        # The node's own subject is allowed. Published until it arrives (like r2's summary
        # above): once in a fresh-clone CI run a single publish right after the forged ones
        # did not arrive within 5 s; the test still fails if it never does.
        async def own_arrived() -> Msg | None:
            await node_a.publish("mg.tel.r1.c1.a", b"own")
            await node_a.flush()
            try:
                return await asyncio.wait_for(seen.get(), 0.5)
            except TimeoutError:
                return None

        try:
            own = await wait_for_value(
                own_arrived, lambda m: m is not None, DEADLINE_S, "the node's own telemetry"
            )
        except AssertionError as exc:  # say what the connections were told
            raise AssertionError(
                f"{exc}; client errors: {errors}; "
                f"node connected: {node_a.is_connected}, reconnects: {node_a.stats}"
            ) from None
        assert own is not None
        assert (own.subject, own.data) == ("mg.tel.r1.c1.a", b"own")
        await wait_until(
            lambda: sum("permissions violation" in e.lower() for e in errors) >= 3,
            DEADLINE_S, "three permissions violations",
        )  # fmt: skip
        assert any('"mg.tel.r1.c1.b"' in e for e in errors)
        assert any('"mg.fed.summary.r1"' in e for e in errors)
        late = [seen.get_nowait() for _ in range(seen.qsize())]  # repeats of "own" only
        assert all((m.subject, m.data) == ("mg.tel.r1.c1.a", b"own") for m in late), late
        drained = []
        while not summaries.empty():
            drained.append(summaries.get_nowait())
        assert all(m.data != b"forged summary" for m in drained)
    finally:
        for nc in (ctl1, ctl2, node_a):
            await nc.close()
