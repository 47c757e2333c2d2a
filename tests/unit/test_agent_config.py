"""Agent config: defaults, the shipped example, and errors that name file, key, problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.agent.config import AgentConfig, ConfigError, load_config, parse_config

EXAMPLE = Path(__file__).parents[2] / "systemd" / "agent.toml"


def test_empty_config_gives_documented_defaults() -> None:
    config = parse_config("")
    assert config == AgentConfig()
    assert config.collect.interval_s == 5.0
    assert config.nats.servers == ("nats://127.0.0.1:4222",)
    assert config.spool.max_bytes == 64 * 1024 * 1024


def test_shipped_example_parses() -> None:
    config = load_config(EXAMPLE)
    assert config.node.region == "us-east-1"
    assert config.collect.intervals["smart"] == 300.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[collect]\ninterval_s = -1", "agent.toml: collect.interval_s: Expected `float` >= 0.1"),
        ("[nats]\nservers = 5", "agent.toml: nats.servers: Expected `array`, got `int`"),
        ("[bogus]\nx = 1", "agent.toml: bogus: unknown key"),
        ("[collect]\nintervall = 1", "agent.toml: collect.intervall: unknown key"),
        ('[node]\nregion = "a.b"', "agent.toml: node.region: Expected `str` matching"),
        ("[spool]\nmax_bytes = 10", "agent.toml: spool.max_bytes: Expected `int` >= 65536"),
        ("x = ", "agent.toml: not valid TOML"),
    ],
)
def test_errors_name_file_key_and_problem(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "agent.toml")
    assert str(info.value).startswith(expected)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.toml: cannot read"):
        load_config(tmp_path / "dir.toml")


def test_node_rdma_keys_travel_in_the_topology() -> None:
    config = parse_config('[node]\nrdma_ports = ["mlx5_0/1", "mlx5_1/1"]\nrdma_rate_gbps = 200\n')
    topology = config.node.topology()
    assert topology is not None
    assert (topology.rdma_ports, topology.rdma_rate_gbps) == (("mlx5_0/1", "mlx5_1/1"), 200.0)
    assert parse_config("").node.topology() is None  # unset: no topology sent
    with pytest.raises(ConfigError, match=r"node\.rdma_ports: Expected `array`, got `str`"):
        parse_config('[node]\nrdma_ports = "mlx5_0/1"\n')
