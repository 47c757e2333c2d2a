"""Every key of a JetStream KV bucket, read from the stream's own per-subject state.

nats-py's ``KeyValue.keys()`` starts a watcher and may end it before the first entry
arrives (it checks the consumer's pending count after the server already pushed the
entries: measured here, about 1 call in 60 right after a write returned too few keys).  A
controller that loads its state with it could start with records missing.  The stream
info request with a subjects filter asks the server instead: no watcher, no race.
"""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.errors import NoKeysError
from nats.js.kv import KeyValue

KV_PREFIX = "$KV."
SERVER_PAGE = 100_000
"""The most subjects nats-server details in one stream info answer."""


async def bucket_keys(js: JetStreamContext, kv: KeyValue) -> list[str]:
    """The keys of ``kv``'s bucket that have a message (deleted ones included: their
    reads raise ``KeyDeletedError``, which callers treat as absent); ``js`` is the
    JetStream context the bucket was opened with (nats-py's public API only)."""
    status = await kv.status()
    stream = status.stream_info.config.name
    if stream is None:
        return []
    pre = f"{KV_PREFIX}{status.bucket}."
    info = await js.stream_info(stream, subjects_filter=f"{pre}>")
    subjects = set(info.state.subjects or {})
    if len(subjects) >= SERVER_PAGE:  # more than one page: add what the watcher finds
        with contextlib.suppress(NoKeysError):
            subjects |= {pre + k for k in await kv.keys()}
    return sorted(s[len(pre) :] for s in subjects if s.startswith(pre))
