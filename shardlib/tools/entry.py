"""The ``shardlib`` command's entry point: SIGTERM and SIGINT are honoured from its first line.

Loading the command line imports JAX, which takes seconds on a busy node, and a scheduler's
preemption (SIGTERM) or a person's Ctrl-C (SIGINT) often lands exactly then. With Python's
own handlers the process would die silently (rc 143) or print a ``KeyboardInterrupt``
traceback. So this module imports nothing but ``signal`` and ``sys`` (``import shardlib`` is
lazy), keeps any signal that arrives while the rest loads, and hands it on: ``shardlib
train`` treats it as if it had come after start-up (the run stops after its first step,
with a checkpoint where it has a directory, and exits 0: ``distributed.preempt``); any
other command stops before it starts with one line. The same signal twice while loading
ends the process at once, with one line. Under ``mpirun`` USR1 is kept too (the preemption
notice ``shardlib launch`` sends: ``distributed.relay``), whose default action would end the
rank. ``shardlib launch`` itself loads no JAX: it only runs and signals the launcher.
"""

from __future__ import annotations

import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGINT)
if "OMPI_COMM_WORLD_SIZE" in os.environ:  # a rank of mpirun: as ``preempt.watched``
    SIGNALS += (signal.SIGUSR1,)
_SEEN: list[str] = []


def _keep(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if name in _SEEN:  # asked twice: stop now, without a traceback
        sys.stderr.write(f"shardlib: {name} again while starting; stopped\n")
        os._exit(130 if signum == signal.SIGINT else 143)
    _SEEN.append(name)


def main(argv: list[str] | None = None) -> int:
    previous = {sig: signal.signal(sig, _keep) for sig in SIGNALS}
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["launch"]:  # runs the launcher and signals it: nothing more to load
        from shardlib.distributed.relay import main as launch

        return launch(args[1:], seen=_SEEN, originals=previous)
    from shardlib.tools import cli  # JAX and the rest load here

    if args[:1] == ["train"]:  # the run takes the handlers over, and what they kept
        code = cli.main(argv, early=_SEEN, originals=previous)  # read once JAX has loaded
        return _leave(code)
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if _SEEN:
        sys.stderr.write(f"shardlib: {_SEEN[0]} while starting; stopped before the command\n")
        return 0 if _SEEN[0] == "SIGTERM" else 130
    return cli.main(argv)


def _leave(code: int) -> int:
    """``code``, or the process ended with it at once when a failed checkpoint save left
    orbax threads that would hold the interpreter's exit for minutes
    (``checkpoint.saver.stranded_threads``): the error line is out, the complete
    checkpoints are intact and the run's files are closed by then."""
    if code:
        from shardlib.checkpoint.saver import stranded_threads

        if stranded_threads():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
