"""Scoring config: defaults, the shipped example, errors naming file/key/problem, docs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from metalguard.controller.core.scoring.config import (
    DEFAULT_SCORING,
    RULE_KEYS,
    ScoringConfig,
    ScoringConfigError,
    load_scoring_config,
    parse_scoring_config,
)

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "scoring.toml"
DOC = ROOT / "docs" / "scoring.md"


def keys(tree: Any, prefix: str = "") -> set[str]:
    """Every dotted key path of a nested dict."""
    if not isinstance(tree, dict):
        return {prefix}
    out: set[str] = set()
    for key, value in tree.items():
        out |= keys(value, f"{prefix}.{key}" if prefix else key)
    return out


def test_empty_config_gives_documented_defaults() -> None:
    config = parse_scoring_config("")
    assert config == DEFAULT_SCORING == ScoringConfig()
    assert (config.grades.healthy_min, config.grades.sub_healthy_min) == (80.0, 50.0)
    assert config.rules.ecc_uncorrectable.severity == "fatal"
    assert config.retention_s() == 86400.0


def test_shipped_example_equals_the_defaults_and_lists_every_key() -> None:
    assert load_scoring_config(EXAMPLE) == DEFAULT_SCORING
    raw = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    assert keys(raw) == keys(msgspec.to_builtins(DEFAULT_SCORING))


def test_a_partial_table_keeps_the_other_defaults() -> None:
    config = parse_scoring_config("[rules.fan_stopped]\npenalty = 40.0\n[grades]\nhealthy_min = 90")
    assert config.rules.fan_stopped.penalty == 40.0
    assert config.rules.fan_stopped.severity == "severe"
    assert config.rules.fan_stopped.max_penalty == 60.0
    assert config.grades == msgspec.structs.replace(DEFAULT_SCORING.grades, healthy_min=90.0)
    assert config.rules.fan_alarm == DEFAULT_SCORING.rules.fan_alarm


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[rules.ecc_correctable_rate]\nwindow_s = -1",
            "scoring.toml: rules.ecc_correctable_rate.window_s: Expected `float` > 0",
        ),
        ("[rules.ecc_bogus]\nenabled = true", "scoring.toml: rules.ecc_bogus: unknown key"),
        (
            "[rules.fan_stopped]\npenalti = 5",
            "scoring.toml: rules.fan_stopped.penalti: unknown key",
        ),
        ("[bogus]\nx = 1", "scoring.toml: bogus: unknown key"),
        (
            '[rules.smart_failed]\nseverity = "deadly"',
            "scoring.toml: rules.smart_failed.severity: Invalid enum value 'deadly'",
        ),
        (
            "[rules.fan_stopped]\npenalty = 101",
            "scoring.toml: rules.fan_stopped.penalty: Expected `float` <= 100",
        ),
        (
            "[rules.nvme_wear]\nwarning_threshold = 90\nsevere_threshold = 80",
            "scoring.toml: rules.nvme_wear: warning_threshold must not exceed severe_threshold",
        ),
        (
            "[grades]\nhealthy_min = 40",
            "scoring.toml: grades: sub_healthy_min must not exceed healthy_min",
        ),
        (
            '[rules.link_downgrade]\nkey_classes = ["network"]',
            "scoring.toml: rules.link_downgrade.key_classes[0]: Expected `str` matching",
        ),
        ("rules = 5", "scoring.toml: rules: Expected `object`, got `int`"),
        ("[history]\nmax_samples_per_key = 1", "scoring.toml: history.max_samples_per_key"),
        ("x = ", "scoring.toml: not valid TOML"),
    ],
)
def test_errors_name_file_key_and_problem(text: str, expected: str) -> None:
    with pytest.raises(ScoringConfigError) as info:
        parse_scoring_config(text, "scoring.toml")
    assert str(info.value).startswith(expected), str(info.value)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ScoringConfigError, match=r"missing\.toml: cannot read"):
        load_scoring_config(tmp_path / "missing.toml")


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "scoring.toml"
    path.write_text("[rules.nvme_spare]\nthreshold = -1\n", encoding="utf-8")
    with pytest.raises(ScoringConfigError, match=r"scoring\.toml: rules\.nvme_spare\.threshold"):
        load_scoring_config(path)


def test_docs_mention_every_rule_and_every_key() -> None:
    text = DOC.read_text(encoding="utf-8")
    tree = msgspec.to_builtins(DEFAULT_SCORING)
    options = {key.rsplit(".", 1)[-1] for key in keys(tree)}
    missing = [name for name in (*RULE_KEYS, *options) if f"`{name}`" not in text]
    assert missing == []


@pytest.mark.parametrize("key", RULE_KEYS)
def test_docs_table_shows_each_rules_max_penalty(key: str) -> None:
    row = next(
        line
        for line in DOC.read_text(encoding="utf-8").splitlines()
        if line.startswith(f"| `{key}` |")
    )
    match = re.search(r"\(max (\d+(?:\.\d+)?)\)", row)
    assert match is not None, row
    assert float(match.group(1)) == DEFAULT_SCORING.rules.get(key).max_penalty
