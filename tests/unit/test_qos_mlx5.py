"""The mlx5 DCQCN backend on a fake sysfs tree (agent/qos/mlx5_backend.py)."""

from __future__ import annotations

from pathlib import Path

from metalguard.agent.qos import mlx5_backend
from metalguard.agent.qos.apply import QosTarget, apply_plan, verify
from metalguard.agent.qos.plan import InterfaceInfo, plan_interface
from metalguard.proto.qos import decode_profile

PROFILE = decode_profile(
    """
version = 2
[dcqcn]
np = { min_time_between_cnps = 4, cnp_dscp = 48 }
rp = { rpg_time_reset = 300, rate_to_set_on_first_cnp = 0 }
""",
    "toml",
)


def fake_tree(root: Path, ifname: str, knobs: dict[str, int]) -> None:
    """``<root>/class/net/<if>/ecn/roce_<side>/<knob>`` files like the driver's."""
    for key, value in knobs.items():
        side, name = key.split(".")
        path = root / "class" / "net" / ifname / "ecn" / f"roce_{side}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")


def knob(root: Path, ifname: str, side: str, name: str) -> str:
    return (root / "class" / "net" / ifname / "ecn" / f"roce_{side}" / name).read_text()


def test_writes_and_verifies_knobs(tmp_path: Path) -> None:
    fake_tree(
        tmp_path,
        "mlx0",
        {
            "np.min_time_between_cnps": 0,
            "np.cnp_dscp": 0,
            "rp.rpg_time_reset": 1,
            "rp.rate_to_set_on_first_cnp": 9,
        },
    )
    target = QosTarget(sysfs=str(tmp_path))
    plan = plan_interface(PROFILE, InterfaceInfo(name="mlx0"))
    result = apply_plan(plan, target)
    assert result.status == "applied", result.reasons
    assert knob(tmp_path, "mlx0", "np", "min_time_between_cnps") == "4\n"
    assert knob(tmp_path, "mlx0", "np", "cnp_dscp") == "48\n"
    assert knob(tmp_path, "mlx0", "rp", "rpg_time_reset") == "300\n"
    assert knob(tmp_path, "mlx0", "rp", "rate_to_set_on_first_cnp") == "0\n"
    assert verify("mlx0", result.expected, target) == []
    # Someone changes a knob: the read-back names the difference.
    (tmp_path / "class/net/mlx0/ecn/roce_rp/rpg_time_reset").write_text("2\n")
    assert verify("mlx0", result.expected, target) == [
        "mlx0: mlx5 roce_rp/rpg_time_reset: expected 300, found 2"
    ]


def test_knob_not_exposed_is_partial(tmp_path: Path) -> None:
    fake_tree(tmp_path, "mlx0", {"np.min_time_between_cnps": 0, "np.cnp_dscp": 0})
    result = apply_plan(
        plan_interface(PROFILE, InterfaceInfo(name="mlx0")), QosTarget(sysfs=str(tmp_path))
    )
    assert result.status == "partial"
    assert result.reasons == [
        "mlx0: mlx5: roce_rp/rate_to_set_on_first_cnp is not exposed",
        "mlx0: mlx5: roce_rp/rpg_time_reset is not exposed",
    ]


def test_interface_without_ecn_dir_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "class" / "net" / "eth0").mkdir(parents=True)
    result = apply_plan(
        plan_interface(PROFILE, InterfaceInfo(name="eth0")), QosTarget(sysfs=str(tmp_path))
    )
    assert result.status == "unsupported"
    assert result.reasons == [
        f"eth0: mlx5: no DCQCN sysfs directory ({tmp_path}/class/net/eth0/ecn)"
    ]


def test_unwritable_knob_fails(tmp_path: Path) -> None:
    fake_tree(tmp_path, "mlx0", {"np.cnp_dscp": 0})
    # A directory where the knob file should be: the write fails as a driver refusal would.
    (tmp_path / "class/net/mlx0/ecn/roce_np/min_time_between_cnps").mkdir()
    result = apply_plan(
        plan_interface(PROFILE, InterfaceInfo(name="mlx0")), QosTarget(sysfs=str(tmp_path))
    )
    assert result.status == "failed"
    assert result.reasons[0].startswith(
        "mlx0: mlx5: cannot write roce_np/min_time_between_cnps: [Errno 21] Is a directory"
    )
    plan = plan_interface(PROFILE, InterfaceInfo(name="mlx0"))
    assert plan.mlx5 is not None
    assert mlx5_backend.read_state("mlx0", ["np.cnp_dscp", "np.nope"], tmp_path) == {
        "np.cnp_dscp": 48,  # written before the failing knob (the reconciler restores)
        "np.nope": None,
    }
