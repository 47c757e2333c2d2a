"""The controller's TOML config (errors name file, key, problem) and its systemd unit."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.controller.config import ConfigError, load_config, parse_config
from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.core.scoring.config import DEFAULT_SCORING
from tests.support.systemd_units import parse_unit

ROOT = Path(__file__).parents[2]
UNIT = ROOT / "systemd" / "metalguard-controller.service"


def test_minimal_config_takes_the_defaults() -> None:
    cfg = parse_config('region = "r1"\n')
    assert cfg.region == "r1"
    assert cfg.nats.servers == ("nats://127.0.0.1:4222",)
    assert cfg.nats.prefix == "mg"
    assert cfg.silence_check_s == 1.0
    assert cfg.lifecycle == LifecycleConfig()
    assert cfg.scoring_config() is DEFAULT_SCORING


def test_the_example_file_parses() -> None:
    cfg = load_config(ROOT / "systemd" / "controller.toml")
    assert cfg.region == "us-east-1"
    assert cfg.lifecycle == LifecycleConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "ctl.toml: region: missing (required)"),
        ('region = "r1"\nfoo = 1\n', "ctl.toml: foo: unknown key"),
        ('region = "r1"\n[nats]\nsrv = []\n', "ctl.toml: nats.srv: unknown key"),
        ('region = "a.b"\n', "ctl.toml: region: Expected `str` matching regex"),
        (
            'region = "r1"\n[lifecycle]\nrail_max_fraction = 2\n',
            "ctl.toml: lifecycle.rail_max_fraction: Expected `float` <= 1",
        ),
        (
            'region = "r1"\n[lifecycle]\nclean_cycles = 2\n',
            "ctl.toml: lifecycle.clean_cycles: unknown key",
        ),
        ('region = "r1"\nsilence_check_s = 0\n', "ctl.toml: silence_check_s: Expected `float` >="),
        ("region = \n", "ctl.toml: not valid TOML"),
        ('region = "r1"\n[ingest]\nshard_index = 1\n', "ctl.toml: ingest: shard_index and"),
        (
            'region = "r1"\n[ingest]\nshard_index = 2\nshard_count = 2\n',
            "ctl.toml: ingest: shard_index must be below",
        ),
        ('region = "r1"\n[ingest]\nclusters = ["a.b"]\n', "ctl.toml: ingest.clusters[0]:"),
    ],
)
def test_errors_name_file_key_and_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "ctl.toml")
    assert str(exc.value).startswith(message), str(exc.value)


def test_ingest_section_is_the_ingest_settings_and_what_the_process_owns() -> None:
    from metalguard.controller.service import ingest_settings

    cfg = parse_config(
        'region = "r1"\n[ingest]\nclusters = ["c1", "c3"]\nshard_index = 0\nshard_count = 2\n'
        "fetch_batch = 64\n"
    )
    settings = ingest_settings(cfg.region, cfg.ingest, "ctl-a")
    assert settings.clusters == ("c1", "c3")
    assert settings.shard == (0, 2)
    assert settings.fetch_batch == 64
    assert settings.durable_prefix == "mg-controller-ctl-a"
    owned = [n for n in (f"n{i}" for i in range(40)) if settings.owns("r1", "c1", n)]
    assert 0 < len(owned) < 40  # about half of c1 by the hash
    assert not any(settings.owns("r1", "c2", f"n{i}") for i in range(40))  # not its cluster
    assert not settings.owns("r2", "c1", owned[0])
    plain = ingest_settings("r1")
    assert plain.owns("r1", "c9", "x")
    assert (plain.clusters, plain.shard) == ((), None)


def test_unreadable_file_and_bad_scoring_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "scoring.toml").write_text("[grades]\nhealthy_min = 'x'\n")
    cfg = parse_config('region = "r1"\nscoring = "scoring.toml"\n')
    with pytest.raises(ConfigError, match=r"scoring\.toml: grades\.healthy_min"):
        cfg.scoring_config(tmp_path)


def test_unit_directives() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    assert "controller run --config /etc/metalguard/controller.toml" in service["ExecStart"][0]
    assert service["Restart"] == ["on-failure"]
    assert service["CapabilityBoundingSet"] == [""]
    assert service["PrivateDevices"] == ["yes"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert "AF_NETLINK" not in service["RestrictAddressFamilies"][0]
