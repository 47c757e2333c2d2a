"""``metalguard agent qos apply``: one local reconcile of a profile file (docs/qos.md).

Operators test a profile on one node with it: ``--dry-run`` prints the plan and touches
nothing; otherwise the plan is applied, read back, and each interface's status printed.
Exit status: 0 when nothing failed, 1 when an interface failed, 2 for a bad profile or
config.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal, TextIO

from metalguard.agent.config import ConfigError, load_config
from metalguard.agent.qos.apply import QosTarget, apply_plan
from metalguard.agent.qos.interfaces import list_interfaces
from metalguard.agent.qos.plan import plan_all, render_plan
from metalguard.agent.qos.tc_backend import TcError
from metalguard.proto.documents import DocumentError, read_text
from metalguard.proto.qos import ProfileError, decode_profile


def main_apply(
    *,
    profile_path: Path,
    interfaces: list[str],
    dry_run: bool,
    config_path: Path | None = None,
    netns: str | None = None,
    sysfs: str | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """CLI body; ``interfaces``, ``netns``, ``sysfs`` override the config's ``[qos]``."""
    try:
        text = read_text(profile_path)
        fmt: Literal["toml", "json"] = "json" if profile_path.suffix.lower() == ".json" else "toml"
        profile = decode_profile(text, fmt)
        config = load_config(config_path) if config_path else None
    except ProfileError as exc:
        for reason in exc.reasons:
            print(f"{profile_path}: {reason}", file=err)
        return 2
    except (ConfigError, DocumentError) as exc:
        print(f"metalguard: {exc}", file=err)
        return 2
    qos = config.qos if config else None
    target = QosTarget(
        netns=netns or (qos.netns if qos else "") or None,
        sysfs=sysfs or (qos.sysfs if qos else "") or (config.collect.sysfs if config else "/sys"),
    )
    override = interfaces or list(qos.interfaces if qos else ())
    try:
        infos = list_interfaces(target.netns, Path(target.sysfs))
    except (OSError, TcError) as exc:
        print(f"metalguard: cannot list interfaces: {exc}", file=err)
        return 1
    plans = plan_all(profile, infos, override)
    if dry_run:
        out.write(render_plan(plans))
        return 0
    failed = False
    for plan in plans:
        result = apply_plan(plan, target)
        failed |= result.status == "failed"
        print(f"{result.interface}: {result.status} (profile version {result.version})", file=out)
        for reason in result.reasons:
            print(f"  {reason}", file=out)
    if not plans:
        out.write(render_plan(plans))
    return 1 if failed else 0
