"""A small HTTP object server over a directory, for bench/cache_bench.py.

Run as its own process (the source of the dataset-cache bench, behind a real network
protocol on loopback)::

    python bench/cache_source_server.py ROOT [--port 0] [--latency-ms 2]

It prints ``serving ROOT at http://HOST:PORT/`` once it listens, then serves until
SIGTERM/SIGINT:

- a file: GET and HEAD with Content-Length, ETag, Last-Modified and Range requests
  (aiohttp's FileResponse: sendfile, ``206 Partial Content``, ``If-None-Match``);
- a directory: an HTML index of ``<a href="NAME">`` links, sub-directories ending in
  ``/``, the form fsspec's HTTPFileSystem lists; a directory's URL without its trailing
  ``/`` is redirected (301) to the URL with it, as http.server and nginx do;
- ``/__stats__``: JSON counters (requests, GETs, HEADs, listings, body bytes sent), so
  the bench can count what was fetched from the source per epoch.

``--latency-ms`` adds a fixed cost to every request before it is answered (an object
store's time to first byte); the wait is asynchronous, so concurrent requests overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import signal
import sys
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

STATS_PATH = "/__stats__"


class Counters:
    """What the server answered since it started."""

    def __init__(self) -> None:
        self.requests = 0
        self.gets = 0
        self.heads = 0
        self.listings = 0
        self.body_bytes = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a JSON-ready dict."""
        return dict(vars(self))


def _listing(directory: Path) -> str:
    rows = []
    for child in sorted(directory.iterdir(), key=lambda p: p.name):
        name = child.name + ("/" if child.is_dir() else "")
        rows.append(f'<a href="{quote(name)}">{html.escape(name)}</a><br>')
    return "<html><body>\n" + "\n".join(rows) + "\n</body></html>\n"


def _range_length(request: web.Request, size: int) -> int:
    """Bytes a GET of a ``size``-byte file sends for this request's Range header."""
    try:
        window = request.http_range
    except ValueError:
        return 0
    start, stop, _ = window.indices(size)
    return max(0, stop - start)


def make_app(root: Path, latency_s: float) -> web.Application:
    """The aiohttp application serving ``root``."""
    root = root.resolve()
    counters = Counters()

    async def handle(request: web.Request) -> web.StreamResponse:
        counters.requests += 1
        if request.path == STATS_PATH:
            return web.json_response(counters.as_dict())
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        head = request.method == "HEAD"
        if head:
            counters.heads += 1
        else:
            counters.gets += 1
        target = (root / request.path.lstrip("/")).resolve()
        if target != root and root not in target.parents:
            raise web.HTTPForbidden()
        if target.is_dir():
            if not request.path.endswith("/"):  # as http.server and nginx do
                raise web.HTTPMovedPermanently(str(request.url.with_path(request.path + "/")))
            counters.listings += 1
            body = _listing(target)
            if not head:
                counters.body_bytes += len(body)
            return web.Response(text=body, content_type="text/html")
        if not target.is_file():
            raise web.HTTPNotFound()
        if not head:
            counters.body_bytes += _range_length(request, target.stat().st_size)
        return web.FileResponse(target)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)  # and HEAD (allow_head)
    return app


async def serve(root: Path, host: str, port: int, latency_s: float) -> None:
    """Serve until SIGTERM or SIGINT; print the address once listening."""
    runner = web.AppRunner(make_app(root, latency_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.base_events.Server)
    bound = server.sockets[0].getsockname()[1]
    print(f"serving {root} at http://{host}:{bound}/", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="cost per request")
    args = parser.parse_args()
    if not args.root.is_dir():
        print(f"not a directory: {args.root}", file=sys.stderr)
        return 2
    asyncio.run(serve(args.root, args.host, args.port, args.latency_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
