"""The HTTP API and the dashboard at 100,000 nodes (docs/benchmarks.md "API and dashboard").

Builds a region's node records in memory (tests/support/harness/api_fleet.py: 32 nodes a
rack, 100 racks a cluster, ~4 % not healthy), serves the real aiohttp app
(``controller.api.app.make_app``) on loopback from a thread, and times requests from a
keep-alive ``http.client`` connection in the main thread, the cases round robin:

- ``healthz``: ``GET /healthz``, the baseline (a trivial route: what HTTP itself costs);
- ``page``: ``GET /v1/nodes?limit=500`` (the first page; ``deep``: a page from the
  middle, by cursor), and with filters: ``grade=FAILING`` (a small bucket),
  ``grade=HEALTHY`` (most nodes), ``cluster=...``, ``rack=...``, ``state=cordoned&grade=...``;
- ``summary``: ``GET /v1/summary?by=rack`` (the dashboard's large heatmap) and ``by=cluster``
  (kept between changes of the index), and ``by=rack rebuilt``: as after a grade change;
- ``legacy``: what ``GET /v1/nodes`` did before it had an index (a sort of every record
  and a line for each match) at ``--nodes`` and at 10,000 nodes: a few requests only.

Prints p50/p99 in ms and p99 against the ``healthz`` p99 of the same run, the goal
(p99 <= 100 ms for a page of 500), the cost of a record write with the index kept
(WatchedRecords) against a plain dict, and, where Chromium and its driver are installed
(Debian's chromium and chromium-driver) with selenium, the dashboard's first paint: the
fleet view on screen (the page's ``metalguard:first-view`` mark, taken after the frame
that shows it) at ``--nodes`` (one cell per rack) and at 1,000 nodes (one per node).

With ``--gc-freeze`` the records and the index are moved out of the cyclic GC's reach once
built (``gc.freeze()``): what a controller that froze after loading its store would see.

Usage: python bench/api_bench.py [--nodes 100000] [--requests 200] [--no-browser] [--quick]
       [--gc-freeze]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the synthetic fleet lives with the integration tests

from metalguard.controller.api.app import make_app  # noqa: E402
from metalguard.controller.api.auth import check_read  # noqa: E402
from metalguard.controller.api.errors import query_params  # noqa: E402
from metalguard.controller.api.node_index import (  # noqa: E402
    WatchedRecords,
    encode_cursor,
    index_of,
)
from metalguard.controller.api.nodes import (  # noqa: E402
    VIEW,
    build_summary,
    parse_grades,
    summary,
)
from metalguard.proto.nodes import NodeRecord  # noqa: E402
from tests.support.harness.api_fleet import FleetView, NoEvents, fleet_view, place  # noqa: E402
from tests.support.harness.headless_chromium import missing_parts, start_chromium  # noqa: E402

GOAL_MS = 100.0
PAINT_GOAL_S = 2.0


async def summary_rebuilt(request: web.Request) -> web.Response:
    """``GET /v1/summary?by=rack`` as after a grade change: built, not the kept body."""
    check_read(request)
    body = build_summary(index_of(request.app[VIEW].store), "rack", None, None)
    return web.Response(body=body, content_type="application/json")


async def legacy_nodes(request: web.Request) -> web.Response:
    """``GET /v1/nodes`` as it was before the index: every record sorted, then filtered."""
    check_read(request)
    query = query_params(request, ("grade", "region", "cluster", "rack"))
    grades = parse_grades(query.get("grade", ""))
    where = {k: v for k, v in query.items() if k != "grade"}
    view = request.app[VIEW]

    def field(r: Any, name: str) -> str:
        return str(r.rack if name == "rack" else getattr(r.node, name))

    nodes = [
        summary(handle, r, view.warm_datasets(handle))
        for handle, r in sorted(view.store.records.items())
        if (not grades or r.grade in grades) and all(field(r, k) == v for k, v in where.items())
    ]
    return web.json_response({"nodes": nodes})


class Server:
    """The app served from its own thread and event loop (the client is not in its way)."""

    def __init__(self, view: FleetView) -> None:
        app = make_app(view, NoEvents())
        app.router.add_get("/bench/legacy-nodes", legacy_nodes)
        app.router.add_get("/bench/summary-rebuilt", summary_rebuilt)
        self._app = app
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self.start_s = 0.0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        runner = web.AppRunner(self._app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> Server:
        t0 = time.perf_counter()
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the API did not start")
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


class Client:
    def __init__(self, port: int) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def get(self, path: str) -> tuple[float, bytes]:
        """Seconds from the request to the whole body, and the body (status 200 required)."""
        t0 = time.perf_counter()
        self._conn.request("GET", path)
        response = self._conn.getresponse()
        body = response.read()
        took = time.perf_counter() - t0
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:200]!r}")
        return took, body


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cases(nodes: int) -> dict[str, str]:
    mid_cluster, mid_rack, _ = place(nodes // 2)
    middle = place(nodes // 2)
    deep = encode_cursor(f"r1.{middle[0]}.{middle[2]}")
    return {
        "healthz": "/healthz",
        "page": "/v1/nodes?limit=500",
        "page deep (cursor)": f"/v1/nodes?limit=500&cursor={deep}",
        "page grade=FAILING": "/v1/nodes?limit=500&grade=FAILING",
        "page grade=HEALTHY": "/v1/nodes?limit=500&grade=HEALTHY",
        "page cluster": f"/v1/nodes?limit=500&cluster={mid_cluster}",
        "page rack": f"/v1/nodes?limit=500&rack={mid_rack}",
        "page state+grade": "/v1/nodes?limit=500&state=cordoned&grade=MAINTENANCE,FAILING",
        "summary by=rack": "/v1/summary?by=rack",
        "summary by=cluster": "/v1/summary?by=cluster",
        "summary by=rack rebuilt": "/bench/summary-rebuilt?by=rack",
    }


class FullCollections:
    """The cyclic GC's full (generation 2) passes while it is entered: how many, the
    longest (with every record in memory, one pass walks them all: a tail latency)."""

    def __init__(self) -> None:
        self.took: list[float] = []
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.took.append(time.perf_counter() - self._t0)

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def line(self) -> str:
        longest = max(self.took, default=0.0) * 1000
        return f"full GC passes meanwhile: {len(self.took)}, the longest {longest:.1f} ms"


def bench_http(client: Client, nodes: int, requests: int) -> dict[str, list[float]]:
    paths = cases(nodes)
    took: dict[str, list[float]] = {name: [] for name in paths}
    for path in paths.values():  # warm up
        client.get(path)
    with FullCollections() as full:
        for _ in range(requests):
            for name, path in paths.items():
                took[name].append(client.get(path)[0])
    print(full.line())
    return took


def print_http(took: dict[str, list[float]], sizes: dict[str, int]) -> None:
    base = pct(took["healthz"], 0.99)
    print(f"{'case':24} {'p50 ms':>8} {'p99 ms':>8} {'p99/healthz':>12} {'bytes':>10}")
    for name, samples in took.items():
        p50, p99 = pct(samples, 0.5) * 1000, pct(samples, 0.99) * 1000
        print(f"{name:24} {p50:8.2f} {p99:8.2f} {p99 / 1000 / base:11.1f}x {sizes[name]:10,}")
    pages = [k for k in took if k.startswith("page")]
    worst = max(pct(took[k], 0.99) for k in pages) * 1000
    verdict = "met" if worst <= GOAL_MS else f"missed by {worst - GOAL_MS:.1f} ms"
    print(f"goal: page of 500 p99 <= {GOAL_MS:.0f} ms: worst page p99 {worst:.2f} ms ({verdict})")


def bench_legacy(nodes: int, reps: int) -> None:
    """The listing before the index, unpaged (every node, and the FAILING ones)."""
    with Server(fleet_view(nodes)) as server:
        client = Client(server.port)
        paths = {
            "every node": "/bench/legacy-nodes",
            "grade=FAILING": "/bench/legacy-nodes?grade=FAILING",
        }
        took: dict[str, list[float]] = {name: [] for name in paths}
        client.get(paths["grade=FAILING"])
        for _ in range(reps):
            for name, path in paths.items():
                took[name].append(client.get(path)[0])
    figures = ", ".join(
        f"{name} p50 {pct(t, 0.5) * 1000:.1f} ms (max {max(t) * 1000:.1f})"
        for name, t in took.items()
    )
    print(f"legacy GET /v1/nodes (no index, unpaged) at {nodes:,} nodes: {figures}")


def bench_writes(view: FleetView, writes: int) -> None:
    """A record write with the index kept against a plain dict, round robin: a steady
    node's next batch (``last_seen_ts``: no bucket moves, the common write) and a grade
    change (a bucket move and two rack counts)."""
    handles = sorted(view.store.records)[:writes]
    plain = dict(view.store.records)
    watched = WatchedRecords(plain)
    kinds: dict[str, Callable[[NodeRecord], NodeRecord]] = {
        "liveness": lambda r: msgspec.structs.replace(r, last_seen_ts=(r.last_seen_ts or 0) + 30),
        "grade change": lambda r: msgspec.structs.replace(r, grade="FAILING", score=1.0),
    }
    for kind, change in kinds.items():
        flips = {h: (plain[h], change(plain[h])) for h in handles}
        best = {"dict": float("inf"), "watched": float("inf")}
        for _ in range(5):
            for name, target in (("dict", plain), ("watched", watched)):
                t0 = time.perf_counter()
                for h in handles:
                    a, b = flips[h]
                    target[h] = b
                    target[h] = a
                best[name] = min(best[name], (time.perf_counter() - t0) / (2 * len(handles)))
        print(
            f"record write ({kind}): dict {best['dict'] * 1e6:.2f} us, with the index "
            f"{best['watched'] * 1e6:.2f} us (+{(best['watched'] - best['dict']) * 1e6:.2f} us)"
        )


@contextmanager
def chromium() -> Iterator[Any]:
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


def first_view_s(driver: Any, url: str, deadline_s: float = 120.0) -> tuple[float, float]:
    """Seconds from navigation to the first view painted (the page's mark) and to the
    first contentful paint (the browser's own, usually the page's empty frame)."""
    driver.get("about:blank")
    driver.get(url)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        mark = driver.execute_script(
            "const m = performance.getEntriesByName('metalguard:first-view');"
            "const p = performance.getEntriesByName('first-contentful-paint');"
            "return m.length ? [m[0].startTime, p.length ? p[0].startTime : -1] : null;"
        )
        if mark:
            return mark[0] / 1000, mark[1] / 1000
        time.sleep(0.05)
    raise RuntimeError(f"{url}: no first view within {deadline_s:.0f} s")


def bench_browser(nodes: int, small: int, reps: int) -> None:
    missing = missing_parts()
    if missing:
        print(f"dashboard: skipped ({', '.join(missing)} missing)")
        return
    with Server(fleet_view(nodes)) as big, Server(fleet_view(small)) as little, chromium() as d:
        rows: dict[str, list[tuple[float, float]]] = {
            f"{small:,} nodes, a cell per node": [],
            f"{nodes:,} nodes, a cell per rack": [],
        }
        urls = dict(
            zip(
                rows,
                (f"http://127.0.0.1:{little.port}/ui/", f"http://127.0.0.1:{big.port}/ui/"),
                strict=True,
            )
        )
        for url in urls.values():
            first_view_s(d, url)  # warm up
        for _ in range(reps):
            for name, url in urls.items():
                rows[name].append(first_view_s(d, url))
        base = statistics.median(v for v, _ in rows[next(iter(rows))])
        print(f"{'dashboard first view':36} {'median s':>9} {'max s':>7} {'fcp s':>6} {'ratio':>6}")
        for name, got in rows.items():
            views = [v for v, _ in got]
            fcp = statistics.median(f for _, f in got)
            med = statistics.median(views)
            print(f"{name:36} {med:9.3f} {max(views):7.3f} {fcp:6.3f} {med / base:5.1f}x")
        worst = max(v for v, _ in rows[f"{nodes:,} nodes, a cell per rack"])
        verdict = "met" if worst <= PAINT_GOAL_S else f"missed by {worst - PAINT_GOAL_S:.2f} s"
        goal = f"goal: first paint at {nodes:,} nodes <= {PAINT_GOAL_S:.0f} s"
        print(f"{goal}: worst {worst:.3f} s ({verdict})")


def timed(what: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    print(f"{what}: {time.perf_counter() - t0:.2f} s")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200, help="per case")
    parser.add_argument("--browser-runs", type=int, default=5)
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument("--quick", action="store_true", help="5,000 nodes, 20 requests")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once the records and the index are built (GC passes skip them)",
    )
    args = parser.parse_args()
    nodes, requests = (5_000, 20) if args.quick else (args.nodes, args.requests)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    view = timed(f"records of {nodes:,} nodes built", lambda: fleet_view(nodes))
    with Server(view) as server:
        print(f"API started (builds the index): {server.start_s:.2f} s")
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
            print(f"gc.freeze(): {gc.get_freeze_count():,} objects out of the GC's passes")
        client = Client(server.port)
        sizes = {name: len(client.get(path)[1]) for name, path in cases(nodes).items()}
        took = bench_http(client, nodes, requests)
    print(f"{requests} requests per case, round robin, one keep-alive connection")
    print_http(took, sizes)
    legacy_reps = 1 if args.quick else 5
    bench_legacy(nodes, legacy_reps)
    if nodes > 10_000:
        bench_legacy(10_000, legacy_reps)  # the largest fleet run before this bench
    bench_writes(view, min(nodes, 20_000))
    if args.no_browser:
        print("dashboard: skipped (--no-browser)")
    else:
        bench_browser(nodes, 1_000, 1 if args.quick else args.browser_runs)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
