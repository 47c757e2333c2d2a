"""Pull requests on one durable JetStream consumer, without a task per message.

nats-py's ``PullSubscription.fetch`` waits for every message with ``next_msg``, which
makes a task, a UUID and a ``wait_for`` timer per message: a tenth of a busy controller's
CPU. ``Puller`` speaks the same pull protocol (docs/protocol.md's consumers; the NATS
``CONSUMER.MSG.NEXT`` API) through one subscription with a callback: a pull request asks
for up to ``batch`` messages, at once (``no_wait``: ended by a ``404``/``408`` status when
fewer are there) or within ``expires`` (ended by a ``408`` when it expires unfilled;
``409``: a conflict, e.g. the consumer was deleted). Like nats-py's fetch, a call returns
what is there now, else waits for the first message. Messages are ordinary ``Msg``
objects (ack, nak, metadata as usual).

A ``Puller`` is made from the NATS ``Client`` and the JetStream API prefix, both public
(``$JS.API`` by default, ``nats.js.api.DEFAULT_PREFIX``). :meth:`Puller.over` takes them
from a ``JetStreamContext`` instead, which nats-py keeps only as private attributes: that
one reading is :func:`context_parts`, guarded by tests/unit/test_nats_private.py (and
nats-py is pinned to the range it was tested with, pyproject.toml).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Mapping
from typing import Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DEFAULT_PREFIX, Header, StatusCode
from nats.js.errors import APIError

from metalguard.runtime.deadlines import within

EXPIRY_MARGIN_S: Final = 1.0
"""How much longer than its ``expires`` a pull waits for the server's word before it
gives up (a connection lost meanwhile: the server's 408 never comes)."""


class ConsumerGoneError(nats.errors.Error):
    """The server said the consumer was deleted (409): re-create it."""


def context_parts(js: JetStreamContext) -> tuple[Client, str]:
    """The connection and the API prefix of a JetStream context (``$JS.API``, or
    ``$JS.<domain>.API``). nats-py has no public accessor: it keeps them as ``_nc`` and
    ``_prefix``; a nats-py that renames them fails here loudly, not later in a pull."""
    try:
        nc, prefix = js._nc, js._prefix
    except AttributeError as exc:  # pragma: no cover - only a nats-py that moved them
        raise RuntimeError(f"this nats-py keeps no JetStream connection/prefix: {exc}") from exc
    if not isinstance(nc, Client) or not isinstance(prefix, str):  # pragma: no cover
        raise RuntimeError("this nats-py's JetStream context holds no Client/prefix")
    return nc, prefix


class Puller:
    """Fetches batches from one durable pull consumer (see the module docstring): ``nc``
    the connection, ``api_prefix`` the JetStream API prefix of its account/domain."""

    def __init__(
        self, nc: Client, stream: str, durable: str, *, api_prefix: str = DEFAULT_PREFIX
    ) -> None:
        self._nc = nc
        self._next = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = self._nc.new_inbox()
        self._queue: deque[Msg] = deque()
        self._wake: asyncio.Event = asyncio.Event()
        self._sub: Subscription | None = None

    @classmethod
    def over(cls, js: JetStreamContext, stream: str, durable: str) -> Puller:
        """A puller on ``js``'s connection and API prefix (see :func:`context_parts`)."""
        nc, prefix = context_parts(js)
        return cls(nc, stream, durable, api_prefix=prefix)

    async def start(self) -> None:
        """Subscribe to the inbox the server delivers to."""
        self._sub = await self._nc.subscribe(self._inbox, cb=self._receive)

    async def unsubscribe(self) -> None:
        """Stop receiving (messages delivered but not fetched are redelivered later)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()

    async def _receive(self, msg: Msg) -> None:
        self._queue.append(msg)
        self._wake.set()

    async def fetch(self, batch: int, expires_s: float) -> list[Msg]:
        """Up to ``batch`` messages, as soon as there are some: those already delivered,
        else what the server has now (a ``no_wait`` pull), else the first to arrive
        within ``expires_s`` (a waiting pull; later ones it delivers are kept for the next
        call). Raises ``nats.errors.TimeoutError`` when none came, ``ConsumerGoneError``
        when the consumer is gone, ``APIError`` on another error status."""
        if self._sub is None:
            raise nats.errors.BadSubscriptionError("the puller is not subscribed")
        msgs = self._take(batch, [])
        if msgs:
            return msgs
        msgs = await self._pull({"batch": batch, "no_wait": True}, batch, expires_s, until_end=True)
        if msgs:
            return msgs
        request = {"batch": batch, "expires": int(expires_s * 1e9)}
        msgs = await self._pull(request, batch, expires_s, until_end=False)
        if not msgs:
            raise nats.errors.TimeoutError
        return msgs

    async def _pull(
        self, request: Mapping[str, object], batch: int, expires_s: float, *, until_end: bool
    ) -> list[Msg]:
        """Send one pull request; collect until ``batch`` messages, the server's end of
        the request, or (``until_end`` false) a moment with some messages and none queued."""
        await self._nc.publish(self._next, json.dumps(request).encode(), reply=self._inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + expires_s + EXPIRY_MARGIN_S
        msgs: list[Msg] = []
        while len(msgs) < batch:
            if not self._queue:
                if msgs and not until_end:
                    break
                self._wake.clear()
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await within(self._wake.wait(), left)
                except TimeoutError:
                    break
            msgs, ended = self._take_until_status(batch, msgs)
            if ended:
                break
        return msgs

    def _take(self, batch: int, msgs: list[Msg]) -> list[Msg]:
        """Messages already queued (status messages of earlier pulls are dropped)."""
        queue = self._queue
        while queue and len(msgs) < batch:
            msg = queue.popleft()
            if _status(msg) is None:
                msgs.append(msg)
        return msgs

    def _take_until_status(self, batch: int, msgs: list[Msg]) -> tuple[list[Msg], bool]:
        """Queued messages up to ``batch``, and whether the server ended this pull."""
        queue = self._queue
        while queue and len(msgs) < batch:
            msg = queue.popleft()
            status = _status(msg)
            if status is None:
                msgs.append(msg)
            elif status in (StatusCode.REQUEST_TIMEOUT, StatusCode.NO_MESSAGES):
                return msgs, True
            elif status == StatusCode.CONFLICT:
                description = (msg.headers or {}).get(Header.DESCRIPTION, "")
                if "deleted" in description.lower():
                    raise ConsumerGoneError(description)
                return msgs, True  # e.g. max ack pending reached: pull again later
            elif status != StatusCode.CONTROL_MESSAGE:
                raise APIError.from_msg(msg)
        return msgs, False


def _status(msg: Msg) -> str | None:
    headers = msg.headers
    return None if headers is None else headers.get(Header.STATUS)
