"""Requests to an http(s) source that fsspec's HTTPFileSystem API does not make.

Two things the cache needs and ``cat_file``/``info`` do not give:

* a GET's *response headers* — the version (size, Last-Modified, ETag) of the very bytes
  it returned, so a miss needs no ``HEAD`` first (:func:`get_with_info`);
* many ``HEAD`` requests at once without a thread each — the background check of cached
  copies, and the sizes an http listing lacks (:func:`head_many`).

Both run on the file system's own event loop and aiohttp session (``fs.loop``,
``fs.set_session()``), with its request options (``fs.kwargs``: headers, auth), and build
the same info dict as ``HTTPFileSystem.info`` does from the same headers, so a version
seen by a GET equals the one a ``HEAD`` reports.  ``Accept-Encoding: identity`` as
fsspec's ``info`` sends it: sizes are the bytes' own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec.asyn

HEAD_CONCURRENCY = 8
"""HEAD requests in flight at once in :func:`head_many`."""
_VERSION_HEADERS = ("ETag", "Content-MD5", "Digest", "Last-Modified")
_GONE = (404, 410)


def info_of(url: str, headers: Mapping[str, str], size: int | None = None) -> dict[str, Any]:
    """The info dict ``HTTPFileSystem.info`` makes of these response headers (``size``:
    the body's length when known, else Content-Length / Content-Range)."""
    info: dict[str, Any] = {"name": url, "type": "file", "size": size}
    if size is None:
        if "Content-Length" in headers and headers.get("Content-Encoding", "") in (
            "",
            "identity",
        ):
            info["size"] = int(headers["Content-Length"])
        elif "Content-Range" in headers:
            info["size"] = int(headers["Content-Range"].split("/")[1])
    for name in _VERSION_HEADERS:
        if headers.get(name):
            info[name] = headers[name]
    return info


def _options(fs: Any) -> dict[str, Any]:
    kw = dict(fs.kwargs)
    kw["headers"] = {**kw.get("headers", {}), "Accept-Encoding": "identity"}
    return kw


async def _get(fs: Any, url: str, limit: int | None) -> tuple[bytes | None, dict[str, Any]]:
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), **_options(fs)) as r:
        if r.status in _GONE:
            raise FileNotFoundError(url)
        r.raise_for_status()
        if limit is not None:
            announced = info_of(url, r.headers)
            if announced["size"] is not None and announced["size"] > limit:
                return None, announced  # the body is not read (the connection is dropped)
        data = await r.read()
        return data, info_of(url, r.headers, len(data))


async def _head(fs: Any, session: Any, url: str) -> dict[str, Any] | None:
    kw = _options(fs)
    kw.setdefault("allow_redirects", True)
    async with session.head(fs.encode_url(url), **kw) as r:
        if r.status in _GONE:
            return None
        r.raise_for_status()
        return info_of(url, r.headers)


async def _heads(
    fs: Any, urls: Sequence[str], limit: int
) -> list[dict[str, Any] | BaseException | None]:
    session = await fs.set_session()
    gate = asyncio.Semaphore(limit)

    async def one(url: str) -> dict[str, Any] | None:
        async with gate:
            return await _head(fs, session, url)

    return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)


def get_with_info(
    fs: Any, url: str, limit: int | None = None
) -> tuple[bytes | None, dict[str, Any]]:
    """GET ``url`` whole: its bytes and the info dict of the response (FileNotFoundError
    for 404/410; other failures as aiohttp raises them).  With ``limit``, a response
    announcing more bytes than that is not read: None and its info."""
    result: tuple[bytes | None, dict[str, Any]] = fsspec.asyn.sync(fs.loop, _get, fs, url, limit)
    return result


def head_many(
    fs: Any, urls: Sequence[str], limit: int = HEAD_CONCURRENCY
) -> list[dict[str, Any] | BaseException | None]:
    """HEAD every URL, ``limit`` at a time: per URL its info dict, None when the server
    says it is gone (404/410), or the exception the request raised."""
    if not urls:
        return []
    results: list[dict[str, Any] | BaseException | None] = fsspec.asyn.sync(
        fs.loop, _heads, fs, urls, limit
    )
    return results
