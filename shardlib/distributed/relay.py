"""``shardlib launch mpirun ...``: a preemption of the launcher command ends the run with a
checkpoint and exit status 0.

A scheduler preempts an MPI job by sending TERM to ``mpirun``. Open MPI 4.1's ``mpirun``
treats a TERM as its own failure: it sends the ranks CONT, TERM and KILL on its
``odls_base_sigkill_timeout`` timers, stops relaying their output, and exits 1 however
cleanly the ranks stopped. A signal it *forwards* is another matter: USR1 (with USR2, CONT,
TSTP, ABRT, ALRM: ``ess_base_forward_signals``) reaches every rank on every node, and
``mpirun`` keeps running, relays what the ranks print and exits with their status.

So ``shardlib launch`` runs the launcher command as a child in a session of its own (a
terminal's Ctrl-C or a TERM to the job's process group reaches the launcher only through
here) and turns the first TERM or INT it is sent into USR1 to the launcher. The ranks take
USR1 as the preemption (``preempt.watched``), stop at the next step boundary with a
checkpoint and exit 0, and so does ``mpirun``, and so does this. A second signal is passed
on as TERM: ``mpirun``'s own stop. The ranks' grace after such a TERM is set to
``launchers.MPIRUN_GRACE_S`` unless the command or the environment sets
``odls_base_sigkill_timeout`` itself.

A signal before the launcher is started ends this with one line and nothing run; one
while it starts is passed on once ``exec`` succeeded (a launcher that has not installed
its own handlers yet then ends at once, and nothing ran). ``mpirun`` forwards USR1 to the
ranks it has started: a preemption while it is still starting them reaches none (the
scheduler's kill at the end of its grace ends that run, as it would without this). No JAX loads here
(``tools.entry`` calls this before the rest of the command line loads).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from shardlib.distributed.launchers import MPIRUN_GRACE_S

NOTICE = signal.SIGUSR1
"""What the launcher is sent on the first TERM/INT: ``mpirun`` forwards it to every rank."""
GRACE_ENV = "OMPI_MCA_odls_base_sigkill_timeout"
"""How ``mpirun`` reads its grace after a TERM from the environment (its ``--mca`` wins)."""
RELAYED = (signal.SIGTERM, signal.SIGINT)


def main(command: list[str], seen: list[str] | None = None, originals: dict | None = None) -> int:
    """Run ``command`` (``mpirun -n 2 ... shardlib train ...``); its exit status, or one
    line and 2 when it cannot be started. ``seen``: the names of signals ``tools.entry``
    kept while this loaded (read after the handlers here replace its own: then the
    launcher is not started); ``originals``: the handlers from before, restored at the end."""
    if not command or command[0].startswith("-"):
        sys.stderr.write(
            "error: shardlib launch: no launcher command. Fix: shardlib launch mpirun -n N "
            "[mpirun options] shardlib train ...\n"
        )
        return 2
    signals: list[int] = []  # received, in order
    sent: list[int] = []  # passed on to the launcher, in order
    child: list[subprocess.Popen] = []

    def forward() -> None:
        while child and len(sent) < len(signals):
            sent.append(NOTICE if not sent else signal.SIGTERM)
            child[0].send_signal(sent[-1])

    def relay(signum: int, frame) -> None:
        signals.append(signum)
        forward()

    replaced = {sig: signal.signal(sig, relay) for sig in RELAYED}
    try:
        early = [*(seen or ()), *(signal.Signals(s).name for s in signals)]
        if early:
            sys.stderr.write(f"shardlib launch: {early[0]} before the launcher started; not run\n")
            return 0 if early[0] == "SIGTERM" else 130
        env = dict(os.environ)
        env.setdefault(GRACE_ENV, str(MPIRUN_GRACE_S))
        try:
            child.append(subprocess.Popen(command, env=env, start_new_session=True))
        except OSError as err:
            sys.stderr.write(f"error: shardlib launch: cannot start {command[0]!r}: {err}\n")
            return 2
        forward()  # a signal that came while it started
        code = child[0].wait()
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, (originals or {}).get(sig, handler))
        if child and child[0].poll() is None:  # this process is failing: no launcher left
            child[0].kill()
    return code if code >= 0 else 128 - code
