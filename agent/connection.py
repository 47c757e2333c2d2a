"""The agent's NATS connection: a bounded first connect, then retries that never end.

nats-py's ``connect()`` never returns while the server is down when reconnects are
unlimited, so each first-connect attempt runs under a deadline
(``runtime.deadlines.within``) and a failed attempt is retried in a background task after a
full-jitter backoff.  Once connected, nats-py reconnects by itself
(``max_reconnect_attempts=-1``); its ``reconnect_to_server_handler`` hook supplies the
same full-jitter delays, since nats-py 2.16 has no jitter option of its own.
``pending_size=0`` turns off the client's reconnect buffer: a publish while disconnected
fails at once instead of sitting in memory, so the publisher can spool it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client, Server
from nats.js import JetStreamContext

from metalguard.agent.backoff import Backoff, Sleep, guarded_task
from metalguard.proto.access import connect_options
from metalguard.proto.access import tls_context as proto_tls_context
from metalguard.runtime.deadlines import within

log = logging.getLogger(__name__)

_EXPECTED_WHILE_DOWN = (OSError, TimeoutError, nats.errors.UnexpectedEOF)
"""Errors a stopped or unreachable server causes; the disconnect itself is logged."""


@dataclass(frozen=True, slots=True)
class NatsSettings:
    """How the agent reaches NATS (the ``[nats]`` config section)."""

    servers: Sequence[str] = ("nats://127.0.0.1:4222",)
    name: str = "metalguard-agent"
    credentials: str | None = None
    """A ``.creds`` file (JWT + nkey seed)."""
    nkey_seed: str | None = None
    """A file holding an nkey seed (nkey auth without JWT)."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    inbox_prefix: str | None = None
    """Reply subjects of this client's requests (its node credentials allow only its own)."""
    tls: ssl.SSLContext | None = None
    """A ready TLS context; overrides ``tls_ca``/``tls_cert``/``tls_key``."""
    connect_timeout_s: float = 2.0
    """One TCP + handshake attempt."""
    first_connect_timeout_s: float = 5.0
    """Deadline of one first-connect attempt (``runtime.deadlines.within``)."""
    reconnect_base_s: float = 0.5
    reconnect_max_s: float = 30.0
    """Full-jitter backoff of connects and reconnects: ``uniform(0, min(max, base*2**n))``."""
    ping_interval_s: float = 10.0
    max_outstanding_pings: int = 3
    js_timeout_s: float = 5.0
    """Default timeout of JetStream API calls."""


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    """The TLS context the settings ask for, or None for plain TCP."""
    if settings.tls is not None:
        return settings.tls
    return proto_tls_context(settings.tls_ca, settings.tls_cert, settings.tls_key)


ClientFactory = Callable[[], Client]
StateListener = Callable[[bool], None]


class Connection:
    """Owns one nats-py client at a time; ``connected`` is set while it is usable."""

    def __init__(
        self,
        settings: NatsSettings,
        *,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        client_factory: ClientFactory = Client,
        on_state: StateListener | None = None,
    ) -> None:
        self.settings = settings
        self.backoff = backoff or Backoff(settings.reconnect_base_s, settings.reconnect_max_s)
        self._tls = tls_context(settings)
        self.connected = asyncio.Event()
        self.attempts = 0
        """First-connect attempts made (reset by a success)."""
        self.disconnects = 0
        self.reconnects = 0
        self._sleep = sleep
        self._client_factory = client_factory
        self._on_state = on_state
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._connector: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def js(self) -> JetStreamContext | None:
        """The JetStream context of the current client, or None before the first connect."""
        return self._js

    @property
    def is_connected(self) -> bool:
        """True while the client is connected (not reconnecting, not closed)."""
        return self._nc is not None and self._nc.is_connected

    async def start(self) -> bool:
        """Try to connect once (bounded); on failure keep trying in the background."""
        if await self._attempt():
            return True
        self._start_connector()
        return False

    async def wait_connected(self) -> None:
        """Return once the connection is usable (wrap in a timeout)."""
        await self.connected.wait()

    async def close(self) -> None:
        """Stop retrying and close the client."""
        self._closing = True
        if self._connector is not None:
            self._connector.cancel()
            await asyncio.gather(self._connector, return_exceptions=True)
            self._connector = None
        nc, self._nc, self._js = self._nc, None, None
        self._set_state(False)
        if nc is not None:
            await _close_quietly(nc)

    # --- first connect ----------------------------------------------------------------
    def _start_connector(self) -> None:
        if self._closing or (self._connector is not None and not self._connector.done()):
            return
        self._connector = guarded_task(
            "nats-connector", self._connect_loop, backoff=self.backoff, sleep=self._sleep
        )

    async def _connect_loop(self) -> None:
        while not self._closing:
            delay = self.backoff.delay(self.attempts - 1)
            log.info("NATS: next connect attempt in %.2fs", delay)
            await self._sleep(delay)
            if await self._attempt():
                return

    async def _attempt(self) -> bool:
        self.attempts += 1
        nc = self._client_factory()
        try:
            await within(nc.connect(**self._options(nc)), self.settings.first_connect_timeout_s)
        except asyncio.CancelledError:
            await _close_quietly(nc)
            raise
        except Exception as exc:
            why = (
                f"no connection within {self.settings.first_connect_timeout_s}s"
                if isinstance(exc, TimeoutError)
                else _describe(exc)
            )
            servers = ",".join(self.settings.servers)
            log.warning("NATS: connect to %s failed (attempt %d): %s", servers, self.attempts, why)
            await _close_quietly(nc)
            return False
        if self._closing:
            await _close_quietly(nc)
            return False
        self._nc, self._js = nc, nc.jetstream(timeout=self.settings.js_timeout_s)
        self.attempts = 0
        log.info("NATS: connected to %s", nc.connected_url.netloc if nc.connected_url else "?")
        self._set_state(True)
        return True

    def _options(self, nc: Client) -> dict[str, Any]:
        s = self.settings

        async def on_error(exc: Exception) -> None:
            if nc is self._nc:  # errors of abandoned attempts were already reported
                quiet = isinstance(exc, _EXPECTED_WHILE_DOWN)  # one per retry: keep them quiet
                log.log(logging.DEBUG if quiet else logging.WARNING, "NATS: %s", _describe(exc))

        async def on_disconnected() -> None:
            if nc is self._nc:
                self.disconnects += 1
                log.warning("NATS: disconnected; reconnecting")
                self._set_state(False)

        async def on_reconnected() -> None:
            if nc is self._nc:
                self.reconnects += 1
                log.info("NATS: reconnected")
                self._set_state(True)

        async def on_closed() -> None:
            if nc is self._nc and not self._closing:
                log.warning("NATS: connection closed; connecting again")
                self._nc = self._js = None
                self._set_state(False)
                self._start_connector()

        opts = connect_options(
            s,
            name=s.name,
            tls=self._tls,
            tls_hostname=s.tls_hostname,
            reconnect_wait_s=s.reconnect_base_s,
        )
        opts.update(
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
            reconnect_to_server_handler=self._pick_server,
            ping_interval=s.ping_interval_s,
            max_outstanding_pings=s.max_outstanding_pings,
            pending_size=0,
        )
        return opts

    def _pick_server(self, servers: list[Server], _info: dict[str, Any]) -> tuple[Server, float]:
        """nats-py's reconnect hook: the least-failed server, after a jittered delay."""
        server = min(servers, key=lambda srv: srv.reconnects)
        return server, self.backoff.delay(server.reconnects)

    def _set_state(self, connected: bool) -> None:
        if connected == self.connected.is_set():
            return
        if connected:
            self.connected.set()
        else:
            self.connected.clear()
        if self._on_state is not None:
            self._on_state(connected)


async def _close_quietly(nc: Client) -> None:
    try:
        await nc.close()
    except Exception as exc:
        log.debug("NATS: error while closing a client: %s", _describe(exc))
    await _end_reconnect_task(nc)


RECONNECT_TASK_DEADLINE_S = 2.0


async def _end_reconnect_task(nc: Client) -> None:
    """Make sure nats-py's reconnect task is gone after ``close()``.

    nats-py cancels it once; a cancel that lands while the task is between awaits can be
    absorbed and the task goes on to its next backoff sleep (seen under load: the task
    outlived the client). Cancel again until it is done, within a deadline.
    """
    task: asyncio.Task[None] | None = getattr(nc, "_reconnection_task", None)
    deadline = asyncio.get_running_loop().time() + RECONNECT_TASK_DEADLINE_S
    while task is not None and not task.done():
        if asyncio.get_running_loop().time() > deadline:
            log.warning("NATS: the client's reconnect task did not end")
            return
        task.cancel()
        await asyncio.wait([task], timeout=0.1)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


Subscribe = Callable[[Client], Awaitable[None]]
"""Makes a client's subscriptions (called once for every new client)."""


class AnsweringConnection:
    """A connection of its own for answering requests (commands): a slow JetStream publish
    elsewhere never delays an answer, and ``subscribe`` runs again on every new client the
    connection creates (a reconnect of the same client keeps its subscriptions)."""

    def __init__(self, settings: NatsSettings, subscribe: Subscribe, what: str) -> None:
        self._subscribe = subscribe
        self._what = what
        self._client: Client | None = None
        self._changed = asyncio.Event()
        self.subscribed = False
        """Whether the current client's subscriptions are in place."""
        self.connection = Connection(
            dataclasses.replace(settings, name=f"{settings.name}-{what}"),
            client_factory=self._new_client,
            on_state=lambda _up: self._changed.set(),
        )

    def _new_client(self) -> Client:
        self._client = Client()
        self.subscribed = False
        return self._client

    async def start(self) -> None:
        """Start connecting (never blocks on NATS)."""
        self._changed.set()
        if not await self.connection.start():
            log.warning("%s: NATS not reachable yet; retrying", self._what)

    async def run(self) -> None:
        """Subscribe on every new client; return only when cancelled."""
        subscribed_on: Client | None = None
        while True:
            await self._changed.wait()
            self._changed.clear()
            client = self._client
            if self.connection.connected.is_set() and client is not subscribed_on:
                assert client is not None
                await self._subscribe(client)
                await client.flush()
                subscribed_on = client
                self.subscribed = True
                log.info("%s: subscribed", self._what)

    async def close(self) -> None:
        """Close the connection (its subscriptions go with it)."""
        await self.connection.close()
