"""A simulated node's kernel log (docs/simulation.md, docs/kmsg.md): the ``kmsg`` fault
appends records in /dev/kmsg's format that the agent's reader and rules take as the
kernel's; a scenario's ``kmsg`` fault needs its line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from metalguard.agent.kmsg.record import parse_record, split_records
from metalguard.agent.kmsg.rules import Finding, match, shipped_rules
from metalguard.demo.sim.faults import KMSG_FILE, FaultError, apply_fault
from metalguard.demo.sim.scenario import ScenarioError, parse_scenario
from metalguard.demo.sim.tree import NodeSpec, write_tree


def test_the_kmsg_fault_logs_kernel_records_the_rules_classify(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "n1", NodeSpec(), 1)
    line = "INFO: task python3:4242 blocked for more than 120 seconds."
    applied = apply_fault(tree, "kmsg", random.Random(1), line=line, count=2)
    assert applied.detail == f"kernel log: {line} (2 times)"
    apply_fault(
        tree, "kmsg", random.Random(1), line="EXT4-fs (sda1): Remounting filesystem read-only"
    )
    records = [parse_record(r) for r in split_records((tree.root / KMSG_FILE).read_text())]
    assert [r.seq for r in records] == [1, 2, 3]
    assert all(r.from_kernel and r.level == 3 for r in records)
    assert records[0].ts_us < records[1].ts_us <= records[2].ts_us
    kinds = [f.kind for r in records if isinstance(f := match(r, shipped_rules()), Finding)]
    assert kinds == ["hung_task", "hung_task", "fs_readonly"]
    with pytest.raises(FaultError, match="needs the line"):
        apply_fault(tree, "kmsg", random.Random(1))


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        ('kind = "kmsg"', "kind 'kmsg' needs the line to log"),
        ('kind = "ecc_ue"\nline = "x"', "only kind 'kmsg' takes a line"),
    ],
)
def test_a_kmsg_fault_needs_its_line(fault: str, problem: str) -> None:
    text = f'[[fault]]\nat = 1\nnode = "r1c1k1n1"\n{fault}\n'
    with pytest.raises(ScenarioError, match=problem):
        parse_scenario(text, "s.toml")
    ok = parse_scenario('[[fault]]\nat = 1\nnode = "r1c1k1n1"\nkind = "kmsg"\nline = "x"\n', "s")
    assert ok.fault[0].line == "x"
