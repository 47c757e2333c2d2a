"""Remediation (and reading) through IPMI.

This machine has no BMC.  Two stand-ins: a shell ``ipmitool`` that keeps a chassis' power
and boot device in files and answers with ipmitool's own texts (always runs), and
OpenIPMI's BMC simulator ``ipmi_sim`` driven by the real ipmitool over IPMI v2.0 LAN
(RMCP+), when both are installed (tests/ensure-tools.sh installs them as root)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from metalguard.agent.bmc import ipmi
from metalguard.agent.bmc.remediation import PowerControl, Remediator, open_control
from metalguard.agent.bmc.targets import BmcTarget
from tests.support.waiting import wait_for_value

FAKE_IPMITOOL = r"""#!/bin/sh
# ipmitool -I lanplus -H h -p p -N n -R r -U u -E chassis ...
state=STATE
while [ $# -gt 0 ] && [ "$1" != chassis ]; do shift; done
shift
echo "$* | pw=$IPMI_PASSWORD" >> $state/log
power=$(cat $state/power)
case "$1 $2" in
  "power status") echo "Chassis Power is $power" ;;
  "power on") echo on > $state/power; echo "Chassis Power Control: Up/On" ;;
  "power off") echo off > $state/power; echo "Chassis Power Control: Down/Off" ;;
  "power soft") echo off > $state/power; echo "Chassis Power Control: Soft" ;;
  "power cycle")
    if [ "$power" = off ]; then
      echo "Set Chassis Power Control to Cycle failed: Command not supported in present state" >&2
      exit 1
    fi
    echo "Chassis Power Control: Cycle" ;;
  "bootdev pxe") echo pxe > $state/bootdev; echo "Set Boot Device to pxe" ;;
  *) echo "Invalid chassis command: $*" >&2; exit 1 ;;
esac
"""


def chassis(tmp_path: Path, power: str = "on") -> tuple[str, Path]:
    state = tmp_path / "chassis"
    state.mkdir()
    (state / "power").write_text(power + "\n")
    tool = tmp_path / "ipmitool"
    tool.write_text(FAKE_IPMITOOL.replace("STATE", str(state)))
    tool.chmod(0o755)
    return str(tool), state


def target(tmp_path: Path) -> BmcTarget:
    creds = tmp_path / "creds.toml"
    creds.write_text('user = "ops"\npassword = "hunter22"\n')
    return BmcTarget(node="eu1.a.n7", address="192.0.2.9", protocol="ipmi", credentials=str(creds))


def remediator(tool: str) -> Remediator:
    @contextlib.asynccontextmanager
    async def opener(t: BmcTarget) -> AsyncIterator[PowerControl]:
        async with open_control(t, tool=tool) as control:
            yield control

    return Remediator(opener=opener, poll_s=0.01, transition_timeout_s=5)


def log(state: Path) -> list[str]:
    return [line.split(" | ")[0] for line in (state / "log").read_text().splitlines()]


async def test_ipmi_force_cycle_graceful_cycle_and_pxe(tmp_path: Path) -> None:
    tool, state = chassis(tmp_path)
    rem = remediator(tool)
    t = target(tmp_path)

    pxe = await rem.execute("i-1", t, "pxe_once")
    assert pxe.ok, pxe.message
    assert (state / "bootdev").read_text().strip() == "pxe"
    assert pxe.message == "Set Boot Device to pxe"

    hard = await rem.execute("i-2", t, "force_power_cycle")
    assert hard.ok, hard.message
    assert (hard.power_state_before, hard.power_state_after) == ("on", "on")

    soft = await rem.execute("i-3", t, "power_cycle")
    assert soft.ok, soft.message
    assert [c for c in log(state) if c != "power status"] == [
        "bootdev pxe",
        "power cycle",
        "power soft",
        "power on",
    ]
    assert all(line.endswith("pw=hunter22") for line in (state / "log").read_text().splitlines())

    again = await rem.execute("i-2", t, "force_power_cycle")
    assert again.duplicate
    assert log(state).count("power cycle") == 1


async def test_ipmi_off_node_is_powered_on(tmp_path: Path) -> None:
    tool, state = chassis(tmp_path, power="off")
    outcome = await remediator(tool).execute("i-on", target(tmp_path), "force_power_cycle")
    assert outcome.ok, outcome.message
    assert (outcome.power_state_before, outcome.power_state_after) == ("off", "on")
    assert "power cycle" not in log(state)


async def test_ipmi_tool_failure_is_a_failed_outcome(tmp_path: Path) -> None:
    outcome = await remediator(str(tmp_path / "missing")).execute(
        "i-x", target(tmp_path), "power_status"
    )
    assert not outcome.ok
    assert "not found" in outcome.message


# --- against OpenIPMI's BMC simulator (ipmi_sim), over the real IPMI LAN protocol ----------

SIM_SDRS = """
sdr type 18
	device_slave_address	0x20
	device_channel_number	0
	chassis			true
	ipmb_event_gen		false
	ipmb_event_recv		false
	fru_inventory		false
	sel			true
	sdr			true
	sensor			true
	entity_id		system_board
	entity_instance		1
	id_string		"mg sim BMC"
endsdr
"""

SIM_SENSOR = """
sdr type 1
	sensor_owner_id		0x20
	sensor_owner_lun	0
	channel_number		0
	sensor_number		{number}
	entity_id		system_board
	entity_instance		1
	sensor_type		{type}
	init_scanning		true
	init_sensor_type	true
	default_sensor_scan_on	true
	event_reading_type_code	1
	analog_data_format	unsigned
	rate_unit		none
	modifier_unit		none
	percentage		false
	base_unit		{unit}
	modifier_unit_code	unspecified
	linearization		linear
	m			{m}
	tolerance		0
	b			0
	accuracy		1
	accuracy_exp		0
	sensor_direction	input
	r_exp			0
	b_exp			0
	sensor_maximum		255
	sensor_minimum		0
	id_string		"{name}"
endsdr
"""

SIM_EMU = """mc_setbmc 0x20
mc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr
sel_enable 0x20 1000 0x0a
sensor_add 0x20 0 1 0x01 0x01
sensor_set_value 0x20 0 1 25 0
sensor_set_threshold 0x20 0 1 settable 111000 60 50 45 00 00 00
sensor_add 0x20 0 2 0x04 0x01
sensor_set_value 0x20 0 2 100 0
mc_enable 0x20
"""

SIM_LAN = """name "mgsim"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 {port}
    priv_limit admin
    allowed_auths_callback none md2 md5 straight
    allowed_auths_user none md2 md5 straight
    allowed_auths_operator none md2 md5 straight
    allowed_auths_admin none md2 md5 straight
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "{control} 0x20"
  user 2 true "ops" "hunter22" admin 10 none md2 md5 straight
"""

SIM_CHASSIS = r"""#!/bin/sh
# ipmi_sim's chassis_control: <device> get <parm>... | <device> set <parm> <val>...
state=STATE
shift
op=$1; shift
case $op in
  get)
    for p in "$@"; do
      case $p in
        power) echo "power:$(cat $state/power)" ;;
        boot) echo "boot:$(cat $state/boot 2>/dev/null || echo default)" ;;
        *) echo "Invalid parameter: $p"; exit 1 ;;
      esac
    done ;;
  set)
    while [ $# -gt 1 ]; do
      echo "$1 $2" >> $state/log
      case $1 in
        power) echo "$2" > $state/power ;;
        boot) echo "$2" > $state/boot ;;
        shutdown) echo 0 > $state/power ;;  # the host OS shuts down at once
      esac
      shift 2
    done ;;
  *) exit 1 ;;
esac
"""

SIM_TOOLS = ("ipmi_sim", "sdrcomp", "ipmitool")


@dataclass
class Simulator:
    address: str
    state: Path
    creds: str

    def target(self, **kw: object) -> BmcTarget:
        fields: dict[str, object] = {
            "node": "eu1.a.n9",
            "address": self.address,
            "protocol": "ipmi",
            "profile": "cipher=3",  # ipmi_sim has no cipher suite 17, ipmitool's default
            "credentials": self.creds,
            "timeout_s": 1.0,
            "retries": 1,
        }
        fields.update(kw)
        return BmcTarget(**fields)  # type: ignore[arg-type]

    def log(self) -> list[str]:
        path = self.state / "log"
        return path.read_text().splitlines() if path.exists() else []


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prepare_simulator(tmp_path: Path) -> tuple[Path, Simulator]:
    """Write ipmi_sim's config, command file, compiled SDRs and chassis script; return
    the lan.conf path and the Simulator handle (port chosen, not yet listening)."""
    state = tmp_path / "chassis"
    state.mkdir()
    (state / "power").write_text("1\n")
    control = tmp_path / "chassis_control"
    control.write_text(SIM_CHASSIS.replace("STATE", str(state)))
    control.chmod(0o755)
    sdrs = tmp_path / "mg.sdrs"
    sdrs.write_text(
        SIM_SDRS
        + SIM_SENSOR.format(number=1, type="Temperature", unit="degrees_C", m=1, name="Inlet Temp")
        + SIM_SENSOR.format(number=2, type="Fan", unit="RPM", m=50, name="Fan1")
    )
    persist = tmp_path / "sim" / "ipmi_sim" / "mgsim"  # <state dir>/ipmi_sim/<name>
    persist.mkdir(parents=True)
    subprocess.run(
        ["sdrcomp", "-o", str(persist / "sdr.20.main"), str(sdrs)], check=True, timeout=30
    )
    port = free_udp_port()
    lan = tmp_path / "lan.conf"
    lan.write_text(SIM_LAN.format(port=port, control=control))
    (tmp_path / "sim.emu").write_text(SIM_EMU)
    creds = tmp_path / "ipmi-creds.toml"
    creds.write_text('user = "ops"\npassword = "hunter22"\n')
    (tmp_path / "bad-creds.toml").write_text('user = "ops"\npassword = "wrong"\n')
    return lan, Simulator(f"127.0.0.1:{port}", state, str(creds))


@pytest.fixture
async def ipmi_sim(tmp_path: Path) -> AsyncIterator[Simulator]:
    """ipmi_sim serving one BMC (a temperature and a fan sensor, chassis power and boot
    device kept in files by its chassis_control script) on a loopback UDP port."""
    missing = [t for t in SIM_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: openipmi, ipmitool)")
    lan, sim = prepare_simulator(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        "ipmi_sim", "-c", str(lan), "-f", str(tmp_path / "sim.emu"),
        "-s", str(tmp_path / "sim"), "-n",
        stdin=asyncio.subprocess.PIPE,  # kept open: it exits on EOF/epoll of /dev/null
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        probe = sim.target()
        argv = ipmi.ipmitool_argv(probe, "ops", "chassis", "power", "status")
        env = ipmi.tool_env("hunter22")
        await wait_for_value(
            lambda: ipmi.run_tool(argv, 5, env), lambda r: r.ok, 10, "ipmi_sim answering"
        )
        yield sim
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_ipmi_sim_sensors_and_power_over_lanplus(ipmi_sim: Simulator) -> None:
    reading = await ipmi.read_bmc(ipmi_sim.target())
    assert reading.reachable, reading.message
    assert reading.power_state == "on"
    sensors = {s.name: s for s in reading.sensors}
    assert (sensors["Inlet Temp"].value, sensors["Inlet Temp"].unit) == (25.0, "C")
    assert (sensors["Fan1"].kind, sensors["Fan1"].value, sensors["Fan1"].unit) == (
        "fan",
        5000.0,
        "rpm",
    )
    assert reading.health == "ok"

    with_thresholds = await ipmi.read_bmc(ipmi_sim.target(profile="cipher=3,thresholds"))
    assert with_thresholds.reachable, with_thresholds.message
    inlet = {s.name: s for s in with_thresholds.sensors}["Inlet Temp"]
    assert (inlet.value, inlet.upper_critical, inlet.lower_critical) == (25.0, 50.0, None)

    wrong = ipmi_sim.target(credentials=str(Path(ipmi_sim.creds).with_name("bad-creds.toml")))
    refused = await ipmi.read_bmc(wrong)
    assert not refused.reachable
    assert refused.message.startswith("ipmitool ")


async def test_ipmi_sim_remediation(ipmi_sim: Simulator) -> None:
    rem = Remediator(poll_s=0.05, transition_timeout_s=10)
    t = ipmi_sim.target()

    pxe = await rem.execute("s-pxe", t, "pxe_once")
    assert pxe.ok, pxe.message
    assert "boot pxe" in ipmi_sim.log()

    off = await rem.execute("s-status", t, "power_status")
    assert (off.ok, off.power_state_before) == (True, "on")

    soft = await rem.execute("s-soft", t, "power_cycle")
    assert soft.ok, soft.message
    assert ipmi_sim.log()[-2:] == ["shutdown 1", "power 1"]
    assert (soft.power_state_before, soft.power_state_after) == ("on", "on")

    hard = await rem.execute("s-hard", t, "force_power_cycle")
    assert hard.ok, hard.message
    assert hard.power_state_after == "on"
    again = await rem.execute("s-hard", t, "force_power_cycle")
    assert again.duplicate


async def test_ipmi_sim_sensors_with_freeipmi(ipmi_sim: Simulator) -> None:
    if shutil.which("ipmi-sensors") is None:
        pytest.skip("ipmi-sensors not installed (Debian: freeipmi-tools)")
    # ipmi_sim hashes the session keys the way FreeIPMI's `opensesspriv` workaround expects
    t = ipmi_sim.target(profile="freeipmi,cipher=3,workaround=opensesspriv")
    reading = await ipmi.read_bmc(t)
    assert reading.reachable, reading.message
    sensors = {s.name: s for s in reading.sensors}
    assert (sensors["Inlet Temp"].kind, sensors["Inlet Temp"].value) == ("temperature", 25.0)
    assert (sensors["Fan1"].kind, sensors["Fan1"].value, sensors["Fan1"].unit) == (
        "fan",
        5000.0,
        "rpm",
    )
    assert reading.message == ""  # nothing skipped: the cache notices stay off stdout
