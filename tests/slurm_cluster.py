"""A one-node Slurm on loopback for the launcher tests: munged, slurmctld and slurmd.

Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them) started from a generated
``slurm.conf`` in a temporary directory: no systemd, no files outside that directory, ports
chosen free, the node named ``localhost`` (so the coordinator address JAX derives from the
node list resolves anywhere). The node claims 8 CPUs whatever the machine has
(``config_overrides``), so that two 2-task steps fit in one allocation. Every daemon runs in
the foreground as a child of the test process and is ended by its PID.
"""

import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import debian_packages

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "scontrol", "sinfo", "salloc")
START_S = 20.0

CONF = """\
ClusterName=shardlibtest
FirstJobId={first_job}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why no Slurm can be started here (None: it can), after installing Debian's packages
    where they are missing and apt and root allow (``debian_packages.ensure``)."""
    why = debian_packages.ensure(("slurm-wlm", "munge"), DAEMONS + CLIENTS)
    if why:  # ensure looks in sbin too: the daemons are not always on PATH
        return why
    if os.geteuid() != 0:
        return "a one-node Slurm is started as root (slurmd runs the tasks as their user)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or next(
        str(Path(d, name)) for d in ("/usr/sbin", "/sbin") if Path(d, name).exists()
    )


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]
    """The environment for Slurm's clients (``SLURM_CONF``), which the jobs inherit."""
    daemons: list[subprocess.Popen]

    def run(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def job_state(self, job: str) -> tuple[str, str]:
        """(JobState, ExitCode) of a job, e.g. ("COMPLETED", "0:0")."""
        out = self.run("scontrol", "show", "job", job).stdout
        fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def logs(self) -> str:
        return "".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        self.run("scancel", "--user", "root", "--full", timeout=10)  # our cluster's jobs only
        for proc in reversed(self.daemons):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start(root: Path, env: dict[str, str], ports: tuple[int, int]) -> Slurm:
    """Start munged, slurmctld and slurmd under ``root``; raise RuntimeError with their logs
    if the node is not idle within ``START_S``."""
    (root / "munge").mkdir(mode=0o700, parents=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    # job ids (and so the coordinator ports derived from them) unlike another such cluster's
    first_job = random.randrange(1000, 1_000_000)
    conf.write_text(
        CONF.format(root=root, ctld_port=ports[0], d_port=ports[1], first_job=first_job)
    )
    env = dict(env, SLURM_CONF=str(conf))
    munge = [_which("munged"), "--foreground", "--force", f"--key-file={key}"]
    munge += [f"--socket={root}/munge/socket", f"--pid-file={root}/munge/pid"]
    munge += [f"--log-file={root}/munged.log", f"--seed-file={root}/munge/seed"]
    log = (root / "daemons.log").open("w")
    cluster = Slurm(root, env, [])
    try:
        for command in (
            munge,
            [_which("slurmctld"), "-D", "-f", str(conf)],
            [_which("slurmd"), "-D", "-N", "localhost", "-f", str(conf)],
        ):
            cluster.daemons.append(
                subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
            if command is munge:
                _wait(lambda: (root / "munge" / "socket").exists(), cluster)
        _wait(lambda: cluster.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ready, cluster: Slurm) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.daemons):
            raise RuntimeError(f"Slurm did not start within {START_S:g} s:\n{cluster.logs()}")
        time.sleep(0.1)
