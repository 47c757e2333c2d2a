"""A real one-node Slurm on loopback for the bridge's tests: munged, slurmctld and slurmd
as children of the ``slurm`` fixture (tests/integration/conftest.py), with every file (key,
config, state, spool, logs) in a temp dir.

``mgnode1`` is served by the one slurmd; ``mgnode2`` is configured on a port nobody
listens on (it has no slurmd), so Slurm sees it DOWN.  The fixture skips, with the reason
printed, where Slurm's daemons are not installed (tests/ensure-tools.sh installs them as
root) or where we are not root (slurmd must be).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

from metalguard.controller.slurm.parse import (
    SlurmJob,
    SlurmNode,
    parse_sinfo_json,
    parse_squeue_json,
)

NODE = "mgnode1"
DEAD_NODE = "mgnode2"
TOOLS = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "scontrol", "sbatch", "scancel")
START_DEADLINE_S = 20.0
CRED_EXPIRE_S = 5
"""How long a requeued job waits before it may start again (Slurm's default is 120 s)."""
SOCKET_PATH_MAX = 107
"""sun_path's 108 bytes less the NUL: slurmstepd's step sockets must fit."""
STEP_SOCKET_TAIL = f"/spool/{NODE}/{NODE}_4294967295.4294967291"
"""The longest step socket below the root (job id and step id at their widest)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_reason() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"Slurm not installed (missing {', '.join(missing)}): tests/ensure-tools.sh"
    if os.geteuid() != 0:
        return "a real Slurm needs root (slurmd runs jobs as their users)"
    return None


class SlurmCluster:
    """The daemons, their config, and the client tools pointed at them."""

    def __init__(self, root: Path) -> None:
        longest = len(str(root)) + len(STEP_SOCKET_TAIL)
        if longest > SOCKET_PATH_MAX:
            raise ValueError(
                f"{root} is too long for Slurm: its step sockets would be {longest} bytes,"
                f" over the {SOCKET_PATH_MAX} a Unix socket path allows; use a shorter dir"
            )
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []

    def write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(mode=0o700, exist_ok=True)
        key = r / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ctld, slurmd, nobody = _free_port(), _free_port(), _free_port()
        self.conf.write_text(
            f"""ClusterName=mgtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/sock,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
SchedulerParameters=sched_interval=2
MessageTimeout=5
KillWait=2
MinJobAge=300
SwitchType=switch/none
NodeName={NODE} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
NodeName={DEAD_NODE} NodeHostname=localhost NodeAddr=127.0.0.1 Port={nobody} CPUs=2 State=UNKNOWN
PartitionName=batch Nodes={NODE},{DEAD_NODE} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, *argv: str) -> None:
        log = open(self.root / "log" / f"{Path(argv[0]).name}.out", "ab")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        finally:
            log.close()
        self._procs.append(proc)

    def start(self) -> None:
        """Start munged, slurmctld and slurmd; return once mgnode1 takes work."""
        self.write_config()
        m = self.root / "munge"
        self._spawn(
            "munged", "-F", "-f", f"--key-file={m}/key", f"--socket={m}/sock",
            f"--pid-file={m}/pid", f"--log-file={m}/log", f"--seed-file={m}/seed",
        )  # fmt: skip
        self._wait(lambda: (m / "sock").exists(), "munged's socket")
        self._spawn("slurmctld", "-D", "-i")
        (self.root / "spool" / NODE).mkdir(exist_ok=True)
        self._spawn("slurmd", "-D", "-N", NODE)
        self._wait(lambda: self._state(NODE) in ("IDLE", "MIXED", "ALLOCATED"), f"{NODE} idle")
        self.run("scontrol", "update", f"NodeName={DEAD_NODE}", "State=DOWN", "Reason=no slurmd")

    def _state(self, name: str) -> str:
        try:
            return self.nodes()[name].state
        except (subprocess.CalledProcessError, KeyError, ValueError):
            return ""

    def _wait(self, predicate: object, what: str) -> None:
        assert callable(predicate)
        deadline = time.monotonic() + START_DEADLINE_S
        while not predicate():
            for proc in self._procs:
                if proc.poll() is not None:
                    raise AssertionError(f"{proc.args!r} exited {proc.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm: no {what} within {START_DEADLINE_S}s: {self.logs()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Cancel the jobs left (a failed test's), then stop every daemon this cluster
        started (TERM, then KILL), newest first."""
        if self._procs:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run("scancel", f"--user={pwd.getpwuid(os.geteuid()).pw_name}")
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def run(self, *argv: str) -> str:
        """Run a client tool against this cluster; its stdout (CalledProcessError if it fails)."""
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=20, check=False
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
        return done.stdout

    def nodes(self) -> dict[str, SlurmNode]:
        return {n.name: n for n in parse_sinfo_json(self.run("sinfo", "--json"))}

    def jobs(self) -> dict[str, SlurmJob]:
        return {j.job_id: j for j in parse_squeue_json(self.run("squeue", "--json"))}

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)
