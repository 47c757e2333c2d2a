"""The bridge's config file (controller/slurm/config.py) and its CLI's exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.cli import main
from metalguard.controller.config import ConfigError
from metalguard.controller.slurm.config import load_bridge_config, parse_bridge_config

EXAMPLE = Path(__file__).parents[2] / "systemd" / "slurm-bridge.toml"


def test_the_shipped_example_is_valid_and_shows_the_defaults() -> None:
    cfg = load_bridge_config(EXAMPLE)
    assert (cfg.region, cfg.cluster, cfg.reason_prefix) == ("us-east-1", "c1", "metalguard:")
    assert cfg == parse_bridge_config('region = "us-east-1"\ncluster = "c1"\n')


def test_node_names_map_both_ways_with_a_default() -> None:
    cfg = parse_bridge_config(
        'region = "r1"\ncluster = "c1"\n[nodes]\n"r1.c1.gpu-017" = "gpu017"\n', "b.toml"
    )
    assert cfg.slurm_name("r1.c1.gpu-017") == "gpu017"
    assert cfg.slurm_name("r1.c1.gpu018") == "gpu018"
    assert cfg.handle_of("gpu017") == "r1.c1.gpu-017"
    assert cfg.handle_of("gpu018") == "r1.c1.gpu018"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('cluster = "c1"', "b.toml: region: missing (required)"),
        (
            'region = "r1"\ncluster = "c1"\n[jobs]\nsignal_scope = "all"',
            "b.toml: jobs.signal_scope",
        ),
        (
            'region = "r1"\ncluster = "c1"\n[slurm]\nattemps = 3',
            "b.toml: slurm.attemps: unknown key",
        ),
        ('region = "r1"\ncluster = "c1"\n[drain]\nmax_fraction = 2', "b.toml: drain.max_fraction"),
        ('region = "r1"\ncluster = "c1"\n[nodes]\n"g1" = "x"', "is not region.cluster.node"),
        ('region = "r1"\ncluster = "c1"\nreason_prefix = " "', "reason_prefix: must not be empty"),
    ],
)
def test_errors_name_the_file_and_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^b\.toml: ") as info:
        parse_bridge_config(text, "b.toml")
    assert message in str(info.value)


def test_the_cli_exits_2_on_a_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bridge.toml"
    bad.write_text('region = "r1"\n')
    assert main(["slurm-bridge", "--config", str(bad)]) == 2
    assert "cluster: missing (required)" in capsys.readouterr().err


def test_the_cli_exits_1_when_nats_is_unreachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "bridge.toml"
    cfg.write_text(
        'region = "r1"\ncluster = "c1"\n[nats]\nservers = ["nats://127.0.0.1:1"]\n'
        "connect_deadline_s = 0.5\n"
    )
    assert main(["slurm-bridge", "--config", str(cfg)]) == 1
    assert "cannot connect to nats://127.0.0.1:1" in capsys.readouterr().err


def test_the_systemd_unit_runs_the_bridge_with_the_example_config_path() -> None:
    unit = (EXAMPLE.parent / "metalguard-slurm-bridge.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith("slurm-bridge --config /etc/metalguard/slurm-bridge.toml")
    assert "/etc/metalguard/slurm-bridge.toml" in EXAMPLE.read_text().splitlines()[0]
    assert "User=slurm" in unit.splitlines()
