"""The dashboard in a real headless Chromium (selenium + Debian's chromium-driver).

1. A headless ``metalguard demo`` plays a one-fault scenario: the browser waits until the
   node turns red on the fleet heatmap, clicks it and reads the reason on the node page.
2. A controller with read tokens: the token given once in ``?token=`` opens the API and
   the live event stream (SSE read with fetch, the token in a header), and a fault turns
   the node red through the stream, well before the slow poll would.
3. A controller with a QoS profile and nodes whose pause counters move: each cluster's
   congestion panel shows the profile version, the rates, the most congested nodes and
   the degraded ones.
4. A controller with provisioning (the real service over the demo's simulated BMC and
   storage): a node booted for a tenant shows its instance state and tenant on the
   heatmap, its page and the instances view.
5. A 100,000-node region (records in memory): one cell per rack, coloured by its worst
   grade; a click opens the rack's nodes (the first paint is timed by bench/api_bench.py).

Screenshots go to ``$MG_ARTIFACTS/dashboard/`` (default ``test-artifacts/dashboard/`` in
the repository); the path is printed.  Skipped, with the reason printed, where Chromium
or its driver is missing (tests/ensure-tools.sh installs them as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.core.topology import TopologyView
from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.jobs.tenant_store import TenantStore
from metalguard.controller.qos import QosStore
from metalguard.demo.sim.provision import SimProvisioning, sim_mac
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.provision import InstanceRequest
from metalguard.proto.qos import decode_profile
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import NetInterface, QosInterfaceStatus, TelemetryBatch
from metalguard.proto.tenants import TenantQuota
from tests.support.clock import T0
from tests.support.harness.api_env import FATAL, FLEET, READ_TOKEN, ApiEnv, api_env
from tests.support.harness.api_fleet import NoEvents, fleet_view
from tests.support.harness.headless_chromium import missing_parts, start_chromium
from tests.support.waiting import wait_for_line

pytest.importorskip("selenium.webdriver", reason="selenium (the dev extra)")
from selenium.common.exceptions import (
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser")]  # one Chromium: ~1 GiB, a core

REPO = Path(__file__).resolve().parents[2]
METALGUARD = Path(sys.executable).parent / "metalguard"
FAULTY = "r1c1k1n2"
SCENARIO = f"""description = "one uncorrectable ECC error"
[[fault]]
at = 2
node = "{FAULTY}"
kind = "ecc_ue"
"""
DEMO_START_S = 40.0
"""NATS, the controller and 4 agents are up within this (usually ~5 s)."""
PAGE_S = 30.0
"""The fault (2 s after the agents are up) reaches the page within this."""
JOB = {
    "name": "llm-small",
    "tenant": "research",
    "nodes": 2,
    "command": "python",
    "args": ["examples/trainer.py", "--steps", "100"],
}
STREAM_S = 10.0
"""An event reaches the page through the stream within this (the slow poll is 30 s)."""


def artifacts() -> Path:
    """Where the screenshots go (printed)."""
    base = Path(os.environ.get("MG_ARTIFACTS") or REPO / "test-artifacts")
    out = base / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    missing = missing_parts()
    if missing:
        reason = f"{' and '.join(missing)} not installed (tests/ensure-tools.sh installs them)"
        print(f"SKIP browser test: {reason}")
        pytest.skip(reason)
    try:
        driver = start_chromium()
    except WebDriverException as exc:  # installed but broken: a failure, not a skip
        pytest.fail(f"chromium is installed but could not start: {exc.msg}")
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, timeout_s: float, what: str, check: Callable[[WebDriver], Any]) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    try:
        return WebDriverWait(
            driver, timeout_s, ignored_exceptions=(StaleElementReferenceException,)
        ).until(check, f"waiting for {what}")
    except Exception:
        shot(driver, "failure")
        raise


def fresh(driver: WebDriver, timeout_s: float, what: str, read: Callable[[WebDriver], Any]) -> Any:
    """``read(driver)`` (finding its elements itself), retried while the page re-renders
    under it (a stale element: the views redraw on every poll, slower on a busy host)."""
    return wait(driver, timeout_s, what, lambda d: (read(d),))[0]


def shot(driver: WebDriver, name: str) -> Path:
    path = artifacts() / f"{name}.png"
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def node_button(driver: WebDriver, node: str, grade: str) -> Any:
    """The heatmap's button of ``node`` once it has ``grade`` (else None)."""
    for button in driver.find_elements(By.CSS_SELECTOR, f'button.node[data-grade="{grade}"]'):
        if (button.get_attribute("data-node") or "").endswith(f".{node}"):
            return button
    return None


def click(button: Any) -> bool:
    button.click()
    return True


def read_red_node(driver: WebDriver, url: str) -> str:
    """Open the fleet, wait for FAULTY to turn red, click it; the node page's reasons."""
    driver.get(url)
    wait(driver, 10, "the fleet heatmap", lambda d: d.find_elements(By.CSS_SELECTOR, "button.node"))
    red = wait(driver, PAGE_S, f"{FAULTY} to turn red", lambda d: node_button(d, FAULTY, "FAILING"))
    assert red.value_of_css_property("background-color") == "rgba(214, 45, 32, 1)"  # --failing
    assert "FAILING" in red.get_attribute("aria-label")
    shot(driver, "fleet-red-node")
    wait(driver, 5, f"a click on {FAULTY}", lambda d: click(node_button(d, FAULTY, "FAILING")))
    reasons = wait(
        driver,
        10,
        "the node page's reasons",
        lambda d: d.find_element(By.ID, "reasons") if d.find_elements(By.ID, "reasons") else None,
    )
    wait(
        driver,
        5,
        "the reason rows",
        lambda d: "uncorrectable" in d.find_element(By.ID, "reasons").text,
    )
    text = str(reasons.text)
    title = driver.find_element(By.ID, "node-title")
    assert title.get_attribute("data-grade") == "FAILING"
    assert FAULTY in title.text
    assert driver.find_elements(By.CSS_SELECTOR, "svg.chart polyline"), "no score chart"
    # the simulated node's IOMMU: a group per GPU and NIC (docs/security.md)
    assert driver.find_element(By.ID, "node-dma").text == "isolated"
    wait(
        driver,
        STREAM_S,
        "the isolation in the live event panel",
        lambda d: d.find_elements(By.CSS_SELECTOR, '#events li[data-kind="node.isolated"]'),
    )
    shot(driver, "node-page")
    return text


async def test_a_fault_turns_a_node_red_and_its_page_says_why(
    browser: WebDriver, tmp_path: Path
) -> None:
    scenario = tmp_path / "one-fault.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    demo = await asyncio.create_subprocess_exec(
        str(METALGUARD), "--log-level", "warning", "demo", "--headless",
        "--duration", "90", "--racks", "1", "--nodes-per-rack", "4",
        "--scenario", str(scenario), "--http", "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert demo.stdout is not None
    seen: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:
        await wait_for_line(demo.stdout, "dashboard: ", DEMO_START_S, seen)
        url = seen[-1].split("dashboard: ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:"), url
        assert url.endswith("/ui/"), url
        drain = asyncio.create_task(_drain(demo.stdout, seen))
        reasons = await asyncio.to_thread(read_red_node, browser, url)
        assert "uncorrectable" in reasons, reasons
        assert "ecc_uncorrectable" in reasons  # the rule column
    finally:
        if demo.returncode is None:
            demo.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(demo.wait(), 20)
            except TimeoutError:
                demo.kill()
                await demo.wait()
        if drain is not None:
            await asyncio.gather(drain, return_exceptions=True)
    assert demo.returncode == 0, "".join(seen)


async def _drain(stream: asyncio.StreamReader, seen: list[str]) -> None:
    """Keep reading the demo's output so that it never blocks on a full pipe."""
    while line := await stream.readline():
        seen.append(line.decode())


# --- tokens and the live stream ---------------------------------------------------------


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[ApiEnv]:
    async with api_env(nc, subjects) as e:
        await e.feed(*FLEET)
        yield e


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_a_read_token_opens_the_api_and_the_stream_turns_a_node_red(
    browser: WebDriver, env: ApiEnv
) -> None:
    app = make_app(env.controller, env.source, read_tokens={READ_TOKEN}, keepalive_s=1.0)
    async with serve(app) as base:
        # without the token: the page says what is needed, nothing else breaks
        await asyncio.to_thread(browser.get, f"{base}/ui/")
        await asyncio.to_thread(
            wait,
            browser,
            10,
            "the token prompt",
            lambda d: "needs a token" in d.find_element(By.ID, "error").text,
        )
        # with it, once in the URL: kept in sessionStorage, gone from the address bar
        await asyncio.to_thread(browser.get, f"{base}/ui/?token={READ_TOKEN}#/fleet")
        await asyncio.to_thread(
            wait,
            browser,
            10,
            "the 4 nodes",
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "button.node")) == 4,
        )
        await asyncio.to_thread(
            wait,
            browser,
            10,
            "the live stream",
            lambda d: d.find_element(By.ID, "conn").get_attribute("data-state") == "live",
        )
        assert READ_TOKEN not in browser.current_url
        assert (
            browser.execute_script("return sessionStorage.getItem('metalguard.token')")
            == READ_TOKEN
        )
        assert node_button(browser, "n3", "HEALTHY") is not None
        await env.feed(FATAL)  # r1.c1.n3: an uncorrectable ECC error -> isolated
        await asyncio.to_thread(
            wait,
            browser,
            STREAM_S,
            "n3 red through the stream",
            lambda d: node_button(d, "n3", "FAILING"),
        )
        await asyncio.to_thread(
            wait,
            browser,
            STREAM_S,
            "the isolation in the event panel",
            lambda d: d.find_elements(By.CSS_SELECTOR, '#events li[data-kind="node.isolated"]'),
        )
        await asyncio.to_thread(shot, browser, "token-stream")
        # this controller has no job manager: the jobs view says so
        await asyncio.to_thread(browser.get, f"{base}/ui/#/jobs")
        await asyncio.to_thread(
            wait,
            browser,
            10,
            "the no-job-API note",
            lambda d: "No job API" in d.find_element(By.ID, "view").text,
        )


@dataclass
class NoNodes:
    """A region without node records: a submitted job stays queued."""

    records: Mapping[str, NodeRecord] = field(default_factory=dict)


async def test_the_jobs_view_lists_the_job_manager_s_jobs_and_the_tenants(
    browser: WebDriver, nc: Client, subjects: Subjects
) -> None:
    async with api_env(nc, subjects) as env:
        js = nc.jetstream(timeout=5)
        tenants = await TenantStore.open(js, subjects)
        await tenants.seed([TenantQuota(name="vision", gpus=32)])
        manager = JobManager(
            nc, js, await JobStore.open(js, subjects), NoNodes(), subjects, "r1",
            fleet=TopologyView().fleet, clock=env.clock, tenants=tenants,
        )  # fmt: skip
        job = await manager.submit(dict(JOB))
        app = make_app(env.controller, env.source, jobs=manager, tenants=manager)
        async with serve(app) as base:
            await asyncio.to_thread(browser.get, f"{base}/ui/#/jobs")
            css = f'#jobs tr[data-job="{job.job_id}"]'
            await asyncio.to_thread(
                wait, browser, 10, "the job's row", lambda d: d.find_elements(By.CSS_SELECTOR, css)
            )
            state, text = await asyncio.to_thread(
                fresh,
                browser,
                10,
                "the job's row read",
                lambda d: (lambda r: (r.get_attribute("data-state"), r.text))(
                    d.find_element(By.CSS_SELECTOR, css)
                ),
            )
            assert state == "queued"
            assert "llm-small" in text
            rows = await asyncio.to_thread(
                fresh,
                browser,
                10,
                "the tenants' rows",
                lambda d: {
                    str(r.get_attribute("data-tenant")): r.text
                    for r in d.find_elements(By.CSS_SELECTOR, "#tenants-quota tr[data-tenant]")
                },
            )
            assert set(rows) == {"research", "vision"}
            assert "32" in rows["vision"]  # its guarantee
            assert "idle only" in rows["research"]  # no quota: its jobs take idle capacity
            await asyncio.to_thread(shot, browser, "jobs")


# --- provisioning (docs/dashboard.md, docs/provisioning.md) ------------------------------


FACTS = "instance"
"""The node page's provisioning facts (their ``data-tenant``)."""


def fleet_provision(driver: WebDriver) -> dict[str, str] | None:
    """What the heatmap says of r1.c1.n1 (booted for acme) and r1.c1.n2 (free), or None
    before it says it."""
    booted = 'button.node[data-node="r1.c1.n1"][data-tenant="acme"]'
    if not driver.find_elements(By.CSS_SELECTOR, booted):
        return None
    button = driver.find_element(By.CSS_SELECTOR, booted)
    free = driver.find_element(By.CSS_SELECTOR, 'button.node[data-node="r1.c1.n2"]')
    line = driver.find_element(By.CSS_SELECTOR, '.rack-tenants li[data-tenant="acme"]')
    return {
        "provision": str(button.get_attribute("data-provision")),
        "label": str(button.get_attribute("aria-label")),
        "free": str(free.get_attribute("data-provision")),
        "tenants": str(driver.find_element(By.ID, "tenants").text),
        "line": str(line.text),
    }


async def test_a_node_booted_for_a_tenant_shows_its_instance_and_tenant(
    browser: WebDriver, env: ApiEnv, nc: Client, subjects: Subjects
) -> None:
    await env.feed(*FLEET)
    macs = {"r1.c1.n1": sim_mac(1), "r1.c1.n2": sim_mac(2)}
    sim = await SimProvisioning.start(
        nc, nc.jetstream(timeout=5), subjects, "r1", env.controller.store, macs,
        boot_delay_s=0.2,
    )  # fmt: skip
    try:
        await sim.service.add_image_from_dir("base", str(REPO / "examples"), 0)
        req = InstanceRequest(tenant="acme", image="base", node="r1.c1.n1", instance_id="a-1")
        await sim.service.create(req)
        await sim.service.wait_for("a-1", ("active",), 20.0)
        app = make_app(env.controller, env.source, provision=sim.service)
        async with serve(app) as base:
            await asyncio.to_thread(browser.get, f"{base}/ui/")
            fleet = await asyncio.to_thread(
                wait, browser, 10, "the tenant's node on the heatmap", fleet_provision
            )  # the page re-renders as events arrive: everything read in one go
            assert fleet["provision"] == "active"
            assert "instance a-1 active, tenant acme" in fleet["label"]
            assert fleet["free"] == "available"
            assert "acme: 1 active" in fleet["tenants"]
            assert fleet["line"] == "n1 acme · active"
            await asyncio.to_thread(shot, browser, "fleet-tenant")
            await asyncio.to_thread(browser.get, f"{base}/ui/#/node/r1.c1.n1")
            tenant = await asyncio.to_thread(
                wait, browser, 10, "the node's instance",
                lambda d: [e.get_attribute("data-tenant") for e in d.find_elements(By.ID, FACTS)],
            )  # fmt: skip
            assert tenant == ["acme"]
            await asyncio.to_thread(browser.get, f"{base}/ui/#/instances")
            rows = await asyncio.to_thread(
                wait, browser, 10, "the instance's row",
                lambda d: [
                    (e.get_attribute("data-state"), e.text)
                    for e in d.find_elements(By.CSS_SELECTOR, '#instances tr[data-instance="a-1"]')
                ],
            )  # fmt: skip
            [(state, text)] = rows
            assert state == "active"
            assert "acme" in text
            await asyncio.to_thread(shot, browser, "instances")
    finally:
        await sim.stop()


# --- the congestion panel (docs/dashboard.md, docs/qos.md) -------------------------------


def congestion_batch(node: str, seq: int, rx: int, degraded: bool = False) -> TelemetryBatch:
    """A batch of ``r1.c1.<node>`` with one interface's received pause frames."""
    verdict = QosInterfaceStatus(
        interface="eth2", version=3, status="degraded", reasons=("np_cnp_sent +0",)
    )
    return TelemetryBatch(
        node=NodeIdentity(region="r1", cluster="c1", node=node),
        seq=seq,
        ts=T0 + seq * 5.0,
        interval_s=5.0,
        net=(NetInterface(name="eth2", rx_pause=rx, tx_pause=0),),
        qos=(verdict,) if degraded else (),
    )


async def test_the_congestion_panel_shows_a_clusters_pause_frames_and_degraded_nodes(
    browser: WebDriver, env: ApiEnv
) -> None:
    qos = await QosStore.open(env.js, env.subjects)
    await qos.put(
        "c1", None, decode_profile("version = 3\n[dcqcn]\nnp = { cnp_dscp = 48 }", "toml")
    )
    await env.feed(
        congestion_batch("n1", 2, 0), congestion_batch("n2", 2, 0, degraded=True),
        congestion_batch("n1", 3, 500), congestion_batch("n2", 3, 50, degraded=True),
    )  # fmt: skip
    app = make_app(env.controller, env.source, qos=qos)
    async with serve(app) as base:
        await asyncio.to_thread(browser.get, f"{base}/ui/#/fleet")
        panel = await asyncio.to_thread(
            wait,
            browser,
            10,
            "cluster c1's congestion panel",
            lambda d: d.find_elements(By.CSS_SELECTOR, '[data-congestion="c1"]'),
        )
        text = panel[0].text
        assert "profile v3" in text, text
        assert "2/3 nodes reporting" in text, text
        assert "pause frames 110/s" in text, text
        top = browser.find_elements(By.CSS_SELECTOR, '[data-congestion="c1"] li[data-congested]')
        assert [li.get_attribute("data-congested") for li in top] == ["r1.c1.n1", "r1.c1.n2"]
        assert "QoS degraded: n2 (eth2)" in text, text
        assert not browser.find_elements(By.CSS_SELECTOR, '[data-congestion="c2"] li'), "c2 quiet"
        await asyncio.to_thread(shot, browser, "congestion")


# --- a large region (docs/dashboard.md "Large regions") ---------------------------------

LARGE = 100_000
"""Nodes of the large region: 3,125 racks of 32 in 32 clusters
(tests/support/harness/api_fleet.py)."""


@pytest.mark.timeout(300)  # 100,000 records built and drawn: minutes on a busy host
async def test_a_100000_node_region_shows_a_cell_per_rack_that_opens_its_nodes(
    browser: WebDriver,
) -> None:
    view = fleet_view(LARGE)
    racks = {(r.node.cluster, r.rack) for r in view.store.records.values()}
    failing = sorted(
        {(r.node.cluster, r.rack) for r in view.store.records.values() if r.grade == "FAILING"}
    )
    app = make_app(view, NoEvents())
    async with serve(app) as base:
        await asyncio.to_thread(browser.get, f"{base}/ui/")
        cells = await asyncio.to_thread(
            wait,
            browser,
            60,
            "a cell per rack",
            lambda d: d.find_elements(By.CSS_SELECTOR, "button.rack-cell"),
        )
        assert len(cells) == len(racks)
        assert not browser.find_elements(By.CSS_SELECTOR, "button.node"), "no cell per node"
        assert f"Fleet: {LARGE} nodes" in browser.find_element(By.ID, "view").text
        assert "One cell per rack" in browser.find_element(By.ID, "summarised").text
        cluster, rack = failing[0]
        css = f'button.rack-cell[data-cluster="{cluster}"][data-rack="{rack}"]'
        grade, label, text = await asyncio.to_thread(
            fresh,
            browser,
            10,
            "the failing rack's cell",
            lambda d: (lambda c: (c.get_attribute("data-grade"), c.get_attribute("aria-label"),
                                  c.text))(d.find_element(By.CSS_SELECTOR, css)),
        )  # fmt: skip
        assert grade == "FAILING"  # its worst grade
        assert "FAILING" in str(label)
        assert text == "32"
        await asyncio.to_thread(shot, browser, "large-region")
        await asyncio.to_thread(
            fresh,
            browser,
            10,
            "the cell clicked",
            lambda d: click(d.find_element(By.CSS_SELECTOR, css)),
        )
        names = await asyncio.to_thread(
            wait,
            browser,
            30,
            f"rack {rack}'s 32 nodes",
            lambda d: (
                len(d.find_elements(By.CSS_SELECTOR, "button.node")) == 32
                and [
                    n.get_attribute("data-node")
                    for n in d.find_elements(By.CSS_SELECTOR, "button.node")
                ]
            ),
        )
        assert {str(n).split(".")[1] for n in names} == {cluster}
        assert browser.find_elements(By.CSS_SELECTOR, 'button.node[data-grade="FAILING"]')
        assert rack in browser.find_element(By.ID, "rack-title").text
        await asyncio.to_thread(shot, browser, "large-region-rack")
        # every node on demand: the link under the heading
        await asyncio.to_thread(browser.get, f"{base}/ui/#/fleet")
        await asyncio.to_thread(
            wait, browser, 60, "the fleet again", lambda d: d.find_elements(By.ID, "summarised")
        )
        link = await asyncio.to_thread(
            fresh,
            browser,
            10,
            "the every-node link",
            lambda d: d.find_element(By.CSS_SELECTOR, '#summarised a[href="#/fleet/nodes"]').text,
        )
        assert link == "every node"
