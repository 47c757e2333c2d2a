"""Permissions and the credentials directory of ``metalguard creds`` (docs/security.md)."""

from __future__ import annotations

import stat
from pathlib import Path

import nkeys  # type: ignore[import-untyped]
import pytest

from metalguard.cli import main
from metalguard.controller.creds.permissions import (
    CredsState,
    User,
    controller_permissions,
    node_permissions,
    render_conf,
    render_federation,
    subscriber_permissions,
    with_user,
)
from metalguard.controller.creds.store import CONF_FILE, CredsError, add, init, load


def test_a_node_publishes_only_its_own_subjects_and_hears_only_its_commands() -> None:
    p = node_permissions("mg", "r1.c1.n7")
    assert p.publish_allow[:2] == ("mg.tel.r1.c1.n7", "mg.evt.r1.c1.n7.>")
    assert p.subscribe_allow == ("mg.cmd.r1.c1.n7.>", "_INBOX_MG.r1.c1.n7.>")
    assert p.allow_responses
    keys = {g.split("$KV.MG_QOS.")[1] for g in p.publish_allow if "$KV" in g}
    assert keys == {"c1.n7", "c1"}, "QoS grants name only the node's and its cluster's keys"
    assert "$JS.API.CONSUMER.CREATE.KV_MG_QOS.*.$KV.MG_QOS.c1.n7" in p.publish_allow
    assert "$JS.API.CONSUMER.CREATE.KV_MG_QOS.*.$KV.MG_QOS.c1" in p.publish_allow
    assert "$JS.API.CONSUMER.CREATE.KV_MG_QOS" in p.publish_allow
    strict = node_permissions("mg", "r1.c1.n7", strict_qos=True)
    assert "$JS.API.CONSUMER.CREATE.KV_MG_QOS" not in strict.publish_allow


def test_a_subscriber_reads_the_control_stream_and_publishes_no_subject_of_the_design() -> None:
    p = subscriber_permissions("mg", "audit")
    assert p.subscribe_allow == ("mg.ctl.>", "_INBOX_MG.sub.audit.>")
    assert all(g.startswith("$JS.") and "MG_CONTROL" in g for g in p.publish_allow)
    assert not p.allow_responses


def test_a_controller_may_not_speak_for_a_node() -> None:
    p = controller_permissions("mg")
    assert set(p.publish_deny) == {"mg.tel.>", "mg.evt.>"}


@pytest.mark.parametrize("bad", ["r1.c1", "r1.c1.n1.x", "r1..n1", "r1.c*.n1"])
def test_a_node_name_must_be_region_cluster_node(bad: str) -> None:
    with pytest.raises(ValueError, match=r"node|region|cluster"):
        node_permissions("mg", bad)


def test_the_conf_lists_every_user_once_and_a_repeat_is_refused() -> None:
    user = User(kind="node", name="r1.c1.n1", nkey="UABC", seed_file="nodes/r1.c1.n1.nk")
    state = with_user(CredsState(), user)
    with pytest.raises(ValueError, match="already exists"):
        with_user(state, user)
    conf = render_conf(state)
    assert conf.count('nkey: "UABC"') == 1
    assert '"mg.tel.r1.c1.n1"' in conf
    assert conf.lstrip().startswith("#")
    assert "authorization {" in conf


def test_init_and_add_write_private_seeds_and_the_conf(tmp_path: Path) -> None:
    directory = tmp_path / "creds"
    (ctl,) = init(directory)
    node = add(directory, "node", "r1.c1.n1")
    assert node.inbox_prefix == "_INBOX_MG.r1.c1.n1"
    assert node.seed_path == directory / "nodes" / "r1.c1.n1.nk"
    seed = node.seed_path.read_bytes().strip()
    assert nkeys.from_seed(seed).public_key.decode() == node.user.nkey
    assert stat.S_IMODE(node.seed_path.stat().st_mode) == 0o600
    conf = (directory / CONF_FILE).read_text()
    assert node.user.nkey in conf
    assert ctl.user.nkey in conf
    assert [u.name for u in load(directory).users] == ["controller", "r1.c1.n1"]
    with pytest.raises(CredsError, match="already exists"):
        add(directory, "node", "r1.c1.n1")
    with pytest.raises(CredsError, match="already holds"):
        init(directory)


def test_cli_reports_a_bad_node_and_a_missing_directory_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["creds", "add-node", "--dir", str(tmp_path), "--node", "r1.c1.n1"]) == 2
    assert "creds init" in capsys.readouterr().err
    assert main(["creds", "init", "--dir", str(tmp_path / "d")]) == 0
    assert main(["creds", "add-node", "--dir", str(tmp_path / "d"), "--node", "n1"]) == 2
    assert "REGION.CLUSTER.NODE" in capsys.readouterr().err


def test_federation_puts_each_region_in_its_account_with_the_fed_subjects_crossing(
    tmp_path: Path,
) -> None:
    for region in ("r1", "r2"):
        init(tmp_path / region, "mg", ("ctl",), False)
        add(tmp_path / region, "node", f"{region}.c1.a")
    r1, r2 = load(tmp_path / "r1"), load(tmp_path / "r2")
    text = render_federation({"r1": r1, "r2": r2})
    r1_block = text[text.index("  R1: {") : text.index("  R2: {")]
    assert "jetstream: enabled" in r1_block
    assert "# node r1.c1.a" in r1_block
    assert "r2.c1.a" not in r1_block
    assert '{ stream: "mg.fed.summary.r1" }' in r1_block
    assert '{ service: "mg.fed.submit.r1" }' in r1_block
    assert '{ stream: { account: R2, subject: "mg.fed.summary.r2" } }' in r1_block
    assert '{ service: { account: R2, subject: "mg.fed.lookup.r2" } }' in r1_block
    assert text.rstrip().endswith("system_account: SYS")
    # the node's permissions are the same as in a one-region authorization block
    assert '"mg.tel.r1.c1.a"' in r1_block


def test_federation_refuses_mixed_prefixes_and_misplaced_nodes(tmp_path: Path) -> None:
    init(tmp_path / "a", "mg", ("ctl",), False)
    init(tmp_path / "b", "xx", ("ctl",), False)
    add(tmp_path / "a", "node", "r2.c1.a")
    a, b = load(tmp_path / "a"), load(tmp_path / "b")
    with pytest.raises(ValueError, match="prefixes differ"):
        render_federation({"r1": a, "r2": b})
    with pytest.raises(ValueError, match=r"node r2\.c1\.a is in the credentials of region r1"):
        render_federation({"r1": a})
    with pytest.raises(ValueError, match="no region"):
        render_federation({})


def test_creds_federate_cli_writes_the_accounts_and_reports_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init(tmp_path / "r1", "mg", ("ctl",), False)
    out = tmp_path / "accounts.conf"
    assert main(["creds", "federate", "--region", f"r1={tmp_path / 'r1'}", "--out", str(out)]) == 0
    assert "R1: {" in out.read_text()
    assert main(["creds", "federate", "--region", "r1", "--out", str(out)]) == 2
    assert "expected REGION=DIR" in capsys.readouterr().err
    missing = tmp_path / "nowhere"
    assert main(["creds", "federate", "--region", f"r2={missing}", "--out", str(out)]) == 2
    assert "holds no credentials" in capsys.readouterr().err
