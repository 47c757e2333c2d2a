"""The one place metalguard reads nats-py's private attributes: a JetStream context's
connection and API prefix (``controller/ingest/pull.py``, :func:`context_parts`). nats-py
is pinned to the range tested here (pyproject.toml); a release that moves them fails this
test loudly, before any pull does. Everything else uses nats-py's public API: this test
also reads the pull, ingest-consumer and KV-key modules and finds no other private
access."""

from __future__ import annotations

import re
from pathlib import Path

from nats.aio.client import Client
from nats.js.api import DEFAULT_PREFIX

from metalguard.controller.ingest import consumer, pull
from metalguard.controller.ingest.pull import Puller, context_parts
from metalguard.controller.state import kv_keys


def test_context_parts_finds_the_connection_and_prefix() -> None:
    nc = Client()  # never connected: nothing opens a socket
    assert context_parts(nc.jetstream()) == (nc, DEFAULT_PREFIX)
    assert context_parts(nc.jetstream(prefix="$JS.hub.API")) == (nc, "$JS.hub.API")
    assert context_parts(nc.jetstream(domain="leaf")) == (nc, "$JS.leaf.API")


def test_a_puller_over_a_context_asks_its_prefix() -> None:
    nc = Client()
    over = Puller.over(nc.jetstream(domain="leaf"), "MG_TELEMETRY", "d1")
    public = Puller(nc, "MG_TELEMETRY", "d1", api_prefix="$JS.leaf.API")
    assert over._next == public._next == "$JS.leaf.API.CONSUMER.MSG.NEXT.MG_TELEMETRY.d1"


def test_no_other_private_nats_attribute_is_read() -> None:
    for module in (pull, consumer, kv_keys):
        source = Path(str(module.__file__)).read_text()
        foreign = re.findall(r"\b(?:js|kv|nc|sub|msg)\._[a-z]\w*", source)
        allowed = ["js._nc", "js._prefix"] if module is pull else []
        assert foreign == allowed
