"""The scoring rules' settings (docs/scoring.md), loaded from TOML with a clear error.

Every rule has a table under ``[rules.<key>]``; a file only needs the keys it changes,
the rest keep their documented defaults (``examples/scoring.toml`` lists them all).
A config error names the file, the key and the problem::

    scoring.toml: rules.ecc_correctable_rate.window_s: Expected `float` > 0.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from metalguard.proto.documents import DocumentError, load_document

Severity = Literal["fatal", "severe", "warning", "info"]
"""fatal: the node is FAILING whatever its score; info: a note that costs nothing."""
SEVERITIES: tuple[Severity, ...] = ("fatal", "severe", "warning", "info")
"""Most serious first (the order reasons are sorted in)."""

Points = Annotated[float, msgspec.Meta(ge=0, le=100)]
WindowS = Annotated[float, msgspec.Meta(gt=0)]
Threshold = Annotated[float, msgspec.Meta(ge=0)]
Level = Annotated[float, msgspec.Meta(gt=0)]
Ratio = Annotated[float, msgspec.Meta(gt=0, le=1)]
PciClassPrefix = Annotated[str, msgspec.Meta(pattern=r"^0x[0-9a-fA-F]{1,6}$")]


class ScoringConfigError(DocumentError):
    """The scoring config is unreadable or invalid; the message names file, key, problem."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class FlagRule(_Section, frozen=True):
    """A rule that fires on a condition: each finding costs ``penalty`` points.

    The findings of one rule together cost at most ``max_penalty`` points.
    """

    enabled: bool
    severity: Severity
    penalty: Points
    max_penalty: Points


class ThresholdRule(FlagRule, frozen=True):
    """A rule that compares one reading with ``threshold``."""

    threshold: Threshold


class WindowThresholdRule(ThresholdRule, frozen=True):
    """A counter's growth over the last ``window_s`` seconds compared with ``threshold``."""

    window_s: WindowS


class LostStateRule(FlagRule, frozen=True):
    """A state seen within the last ``window_s`` seconds that has been gone for ``grace_s``
    seconds or more (an RDMA port that was ACTIVE and is not)."""

    window_s: WindowS
    """How long a state once seen is remembered."""
    grace_s: Threshold
    """How long it may be gone before the rule fires (0: at the first batch without it)."""


class MarginRule(FlagRule, frozen=True):
    """A temperature within ``margin_celsius`` of its critical limit."""

    margin_celsius: Threshold


class FanPeerRule(FlagRule, frozen=True):
    """A fan below ``ratio`` of the median of the node's other spinning fans."""

    ratio: Ratio
    min_fans: Annotated[int, msgspec.Meta(ge=2)]
    """Spinning fans the node needs (this one included) before peers are compared."""


class LevelPenalties(_Section, frozen=True):
    """A rule with two levels: warning and severe, each with its own penalty."""

    enabled: bool
    warning_penalty: Points
    severe_penalty: Points
    max_penalty: Points


class LevelRule(LevelPenalties, frozen=True):
    """Two thresholds: at ``warning_threshold`` a warning, at ``severe_threshold`` severe."""

    warning_threshold: Level
    severe_threshold: Level

    def __post_init__(self) -> None:
        if self.warning_threshold > self.severe_threshold:
            raise ValueError("warning_threshold must not exceed severe_threshold")


class RateRule(LevelRule, frozen=True):
    """A counter's rate: errors per hour, counted over the last ``window_s`` seconds."""

    window_s: WindowS


class GrowthRule(_Section, frozen=True):
    """A disk counter: its growth over ``window_s`` and its total, judged separately.

    A threshold of 0 turns that half of the rule off.
    """

    enabled: bool
    window_s: WindowS
    growth_threshold: Threshold
    growth_severity: Severity
    growth_penalty: Points
    total_threshold: Threshold
    total_severity: Severity
    total_penalty: Points
    max_penalty: Points


class LinkDowngradeRule(FlagRule, frozen=True):
    """A PCIe link of an accelerator or NIC below its maximum speed or width."""

    key_classes: tuple[PciClassPrefix, ...]
    """PCI class prefixes of accelerators and NICs (``0x02`` network, ``0x03`` display,
    ``0x12`` processing accelerator); other devices fall to ``link_downgrade_other``."""
    speed_exempt_classes: tuple[PciClassPrefix, ...]
    """Classes whose speed drop alone is not a downgrade (GPUs lower it when idle)."""


class Grades(_Section, frozen=True):
    """``[grades]``: the score boundaries of HEALTHY and SUB_HEALTHY."""

    healthy_min: Points = 80.0
    sub_healthy_min: Points = 50.0

    def __post_init__(self) -> None:
        if self.sub_healthy_min > self.healthy_min:
            raise ValueError("sub_healthy_min must not exceed healthy_min")


class History(_Section, frozen=True):
    """``[history]``: how much counter history a node keeps."""

    max_samples_per_key: Annotated[int, msgspec.Meta(ge=2, le=100_000)] = 512
    """Samples kept per counter; unchanged readings are merged, so only counters that
    change nearly every cycle reach it (the oldest samples go first)."""


def _flag(severity: Severity, penalty: float, max_penalty: float) -> FlagRule:
    return FlagRule(enabled=True, severity=severity, penalty=penalty, max_penalty=max_penalty)


def _threshold(
    severity: Severity, penalty: float, max_penalty: float, threshold: float
) -> ThresholdRule:
    return ThresholdRule(
        enabled=True,
        severity=severity,
        penalty=penalty,
        max_penalty=max_penalty,
        threshold=threshold,
    )


def _rate(warning: float, severe: float, warning_penalty: float, severe_penalty: float) -> RateRule:
    return RateRule(
        enabled=True,
        window_s=3600.0,
        warning_threshold=warning,
        warning_penalty=warning_penalty,
        severe_threshold=severe,
        severe_penalty=severe_penalty,
        max_penalty=2 * severe_penalty,
    )


def _net_rate(
    window_s: float, warning: float, severe: float, warning_penalty: float, severe_penalty: float
) -> RateRule:
    return RateRule(
        enabled=True,
        window_s=window_s,
        warning_threshold=warning,
        warning_penalty=warning_penalty,
        severe_threshold=severe,
        severe_penalty=severe_penalty,
        max_penalty=2 * severe_penalty,
    )


def _growth(
    total: float, total_penalty: float, growth_severity: Severity, growth_penalty: float
) -> GrowthRule:
    return GrowthRule(
        enabled=True,
        window_s=86400.0,
        growth_threshold=1,
        growth_severity=growth_severity,
        growth_penalty=growth_penalty,
        total_threshold=total,
        total_severity="warning",
        total_penalty=total_penalty,
        max_penalty=2 * growth_penalty,
    )


class Rules(_Section, frozen=True):
    """``[rules.<key>]``: every rule, by the key its reasons carry in ``Reason.rule``."""

    # memory
    ecc_uncorrectable: ThresholdRule = _threshold("fatal", 100, 100, 1)
    ecc_correctable_rate: RateRule = _rate(10, 100, 10, 30)
    # PCIe
    aer_fatal: ThresholdRule = _threshold("fatal", 100, 100, 1)
    aer_nonfatal: ThresholdRule = _threshold("fatal", 100, 100, 1)
    aer_correctable_rate: RateRule = _rate(10, 100, 5, 20)
    link_downgrade: LinkDowngradeRule = LinkDowngradeRule(
        enabled=True,
        severity="severe",
        penalty=30,
        max_penalty=60,
        key_classes=("0x02", "0x03", "0x12"),
        speed_exempt_classes=("0x03",),
    )
    link_downgrade_other: FlagRule = _flag("warning", 5, 15)
    link_retrains: WindowThresholdRule = WindowThresholdRule(
        enabled=True, severity="warning", penalty=5, max_penalty=20, threshold=3, window_s=3600
    )
    # disks
    smart_failed: FlagRule = _flag("fatal", 100, 100)
    nvme_critical_warning: FlagRule = _flag("severe", 30, 60)
    nvme_media_errors: GrowthRule = _growth(1, 5, "severe", 30)
    nvme_wear: LevelRule = LevelRule(
        enabled=True,
        warning_threshold=80,
        warning_penalty=5,
        severe_threshold=100,
        severe_penalty=20,
        max_penalty=40,
    )
    nvme_spare: ThresholdRule = _threshold("warning", 10, 20, 20)
    ata_reallocated: GrowthRule = _growth(10, 5, "severe", 30)
    ata_pending: GrowthRule = _growth(1, 10, "severe", 30)
    ata_offline_uncorrectable: GrowthRule = _growth(1, 10, "severe", 30)
    ata_reported_uncorrectable: GrowthRule = _growth(1, 10, "severe", 30)
    scsi_grown_defects: GrowthRule = _growth(100, 5, "warning", 10)
    # GPUs (NVML)
    gpu_ecc_uncorrectable: ThresholdRule = _threshold("fatal", 100, 100, 1)
    gpu_row_remap_failure: FlagRule = _flag("fatal", 100, 100)
    gpu_reset_pending: FlagRule = _flag("severe", 30, 30)
    """Several GPUs waiting for a reset cost no more than one: SUB_HEALTHY, reset together."""
    gpu_xid_reboot: FlagRule = _flag("fatal", 100, 100)
    gpu_xid_attention: FlagRule = _flag("warning", 10, 20)
    gpu_pcie_downgrade: FlagRule = _flag("severe", 30, 60)
    gpu_thermal_slowdown: FlagRule = _flag("warning", 10, 30)
    gpu_ecc_correctable_rate: RateRule = _rate(10, 100, 10, 30)
    """The same as a DIMM's (``ecc_correctable_rate``): a storm costs the same anywhere."""
    gpu_pcie_replay_rate: RateRule = _rate(100, 10_000, 5, 20)
    gpu_nvlink_error_rate: RateRule = _rate(100, 10_000, 10, 30)
    # cooling
    fan_stopped: FlagRule = _flag("severe", 30, 60)
    fan_below_min: FlagRule = _flag("warning", 10, 30)
    fan_alarm: FlagRule = _flag("warning", 10, 30)
    kmsg_fatal: WindowThresholdRule = WindowThresholdRule(
        enabled=True, severity="fatal", penalty=100, max_penalty=100, threshold=1, window_s=3600
    )
    kmsg_severe: WindowThresholdRule = WindowThresholdRule(
        enabled=True, severity="severe", penalty=30, max_penalty=30, threshold=1, window_s=3600
    )
    kmsg_warning: WindowThresholdRule = WindowThresholdRule(
        enabled=True, severity="warning", penalty=10, max_penalty=20, threshold=1, window_s=3600
    )
    fan_peer_outlier: FanPeerRule = FanPeerRule(
        enabled=True, severity="warning", penalty=10, max_penalty=30, ratio=0.5, min_fans=3
    )
    temp_critical: FlagRule = _flag("fatal", 100, 100)
    temp_near_critical: MarginRule = MarginRule(
        enabled=True, severity="severe", penalty=30, max_penalty=60, margin_celsius=5
    )
    temp_above_max: FlagRule = _flag("warning", 5, 20)
    # out of band
    bmc_health: LevelPenalties = LevelPenalties(
        enabled=True, warning_penalty=10, severe_penalty=30, max_penalty=30
    )
    bmc_sensor: LevelPenalties = LevelPenalties(
        enabled=True, warning_penalty=5, severe_penalty=20, max_penalty=40
    )
    bmc_unreachable: FlagRule = _flag("info", 0, 0)
    # network (per interface; rates per hour, see docs/scoring.md)
    net_error_rate: RateRule = _net_rate(600, 60, 3600, 5, 20)
    net_drop_rate: RateRule = _net_rate(600, 36_000, 3_600_000, 5, 15)
    net_pause_storm: RateRule = _net_rate(300, 3_600_000, 36_000_000, 10, 30)
    tc_lossless_drops: RateRule = _net_rate(600, 1, 3600, 10, 30)
    # RDMA (InfiniBand and RoCE ports; rates per hour, see docs/scoring.md "RDMA")
    rdma_port_down: LostStateRule = LostStateRule(
        enabled=True, severity="fatal", penalty=100, max_penalty=100, window_s=86400, grace_s=0
    )
    rdma_cabled_port_down: FlagRule = _flag("fatal", 100, 100)
    rdma_link_flap_rate: RateRule = _rate(1, 3, 10, 30)
    rdma_phys_error_rate: RateRule = _rate(10, 100, 10, 30)
    rdma_rate_below_expected: FlagRule = _flag("severe", 30, 60)
    rdma_retransmit_rate: RateRule = _net_rate(600, 3600, 360_000, 5, 20)
    rdma_counter_saturated: FlagRule = _flag("info", 0, 0)
    # the pipeline itself
    collector_failed: FlagRule = _flag("warning", 2, 10)
    counter_reset: FlagRule = _flag("info", 0, 0)

    def get(self, key: str) -> AnyRule:
        """The settings of the rule named ``key`` (a field of this table)."""
        rule: AnyRule = getattr(self, key)
        return rule


AnyRule = FlagRule | LevelPenalties | GrowthRule
RULE_KEYS: tuple[str, ...] = Rules.__struct_fields__
"""Every rule's key, in the order of the config file."""


class ScoringConfig(_Section, frozen=True):
    """The whole scoring configuration."""

    grades: Grades = Grades()
    history: History = History()
    rules: Rules = Rules()

    def retention_s(self) -> float:
        """How long counter samples are kept: the longest window of any rule."""
        return max(getattr(self.rules.get(key), "window_s", 0.0) for key in RULE_KEYS)


DEFAULT_SCORING = ScoringConfig()


def parse_scoring_config(text: str, source: str = "<scoring>") -> ScoringConfig:
    """Parse TOML text over the defaults; raise ScoringConfigError naming source, key, problem."""
    return load_document(
        text, ScoringConfig, source=source, error=ScoringConfigError, prepare=_over_defaults
    )


def load_scoring_config(path: Path) -> ScoringConfig:
    """Read and parse the scoring config file at ``path``."""
    return load_document(path, ScoringConfig, error=ScoringConfigError, prepare=_over_defaults)


def _over_defaults(raw: dict[str, Any]) -> Any:
    """A file's tables laid over the default settings."""
    return _merge(msgspec.to_builtins(DEFAULT_SCORING), raw)


def _merge(defaults: Any, override: Any) -> Any:
    """``override`` laid over ``defaults``, table by table (other values replace)."""
    if not (isinstance(defaults, dict) and isinstance(override, dict)):
        return override
    merged = dict(defaults)
    for key, value in override.items():
        merged[key] = _merge(defaults[key], value) if key in defaults else value
    return merged
