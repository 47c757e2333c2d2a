"""The shard map of ``[shards]`` and its pure decisions (controller/shards/plan.py), and
the cluster harness's member config (controller/broker/cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.controller.broker.cluster import ServerPorts, server_config
from metalguard.controller.config import ConfigError, parse_config
from metalguard.controller.shards.plan import (
    ShardsSection,
    candidates,
    durable_prefix,
    owns_event,
    shard_key,
)
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import ControllerEvent

CONFIG = """
region = "r1"
[ha]
instance = "ctl-a"
[shards]
home = ["s0"]
[shards.groups]
s0 = ["c0", "c1"]
s1 = ["c2"]
s2 = ["c3"]
"""


def test_config_reads_the_shard_map() -> None:
    cfg = parse_config(CONFIG)
    assert cfg.shards is not None
    assert cfg.shards.groups == {"s0": ("c0", "c1"), "s1": ("c2",), "s2": ("c3",)}
    assert cfg.shards.home == ("s0",)
    assert cfg.shards.takeover
    assert parse_config('region = "r1"').shards is None


@pytest.mark.parametrize(
    ("groups", "home", "problem"),
    [
        ({"s0": ["c0"], "s1": ["c0"]}, [], "cluster 'c0' is in shards 's0' and 's1'"),
        ({"s0": []}, [], "a shard has at least one cluster"),
        ({"s0": ["c0"]}, ["s9"], "'s9' is not a shard of groups"),
        ({}, [], "groups"),
    ],
)
def test_a_bad_shard_map_is_refused(
    groups: dict[str, list[str]], home: list[str], problem: str
) -> None:
    lines = [
        'region = "r1"',
        "[ha]",
        'instance = "a"',
        "[shards]",
        f"home = {home!r}".replace("'", '"'),
        "[shards.groups]",
    ]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in groups.items()]
    with pytest.raises(ConfigError, match=problem):
        parse_config("\n".join(lines))


def test_home_shards_come_first_then_the_others() -> None:
    section = ShardsSection(groups={"s0": ("a",), "s1": ("b",), "s2": ("c",)}, home=("s1",))
    assert candidates(section) == [("s1", True), ("s0", False), ("s2", False)]
    spare = ShardsSection(groups={"s0": ("a",)}, home=("s0",), takeover=False)
    assert candidates(spare) == [("s0", True)]


def test_keys_and_durables_are_per_shard() -> None:
    assert shard_key("r1", "s0") == "shard.r1.s0"
    assert durable_prefix("s0") == "mg-shard-s0"


def event(cluster: str | None) -> ControllerEvent:
    node = None if cluster is None else NodeIdentity(region="r1", cluster=cluster, node="n1")
    return ControllerEvent(event_id="e1", ts=1.0, region="r1", kind="node.isolated", node=node)


def test_a_shard_publishes_its_own_clusters_pending_events_and_unnamed_ones() -> None:
    mine = frozenset({"c0"})
    assert owns_event(event("c0"), mine)
    assert not owns_event(event("c1"), mine)
    assert owns_event(event(None), mine)


def test_a_cluster_member_routes_to_every_other_member() -> None:
    text = server_config("n1", ServerPorts(4001, 6001, 8001), [6001, 6002, 6003], Path("/d/n1"))
    assert "listen: 127.0.0.1:4001" in text
    assert "http: 127.0.0.1:8001" in text
    assert 'store_dir: "/d/n1"' in text
    assert "nats-route://127.0.0.1:6002" in text
    assert "nats-route://127.0.0.1:6003" in text
    assert "nats-route://127.0.0.1:6001" not in text


def test_shards_need_an_instance_and_no_ingest_split_of_their_own() -> None:
    with pytest.raises(ConfigError, match=r"\[shards\] needs \[ha\] instance"):
        parse_config(CONFIG.replace('[ha]\ninstance = "ctl-a"\n', ""))
    with pytest.raises(ConfigError, match="leave \\[ingest\\] clusters"):
        parse_config(CONFIG + '[ingest]\nclusters = ["c0"]\n')
