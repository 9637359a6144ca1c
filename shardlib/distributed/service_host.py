"""JAX's coordination service in a small process of its own, so that losing process 0 ends
the other processes with one line instead of a C++ abort.

``jax.distributed.initialize`` starts the coordination service inside process 0. When that
process dies, every other process's coordination client sees the service vanish at once
(its error poll fails) and JAX's fatal handler aborts it: SIGABRT, an 11-frame C++ stack
trace, and no word on which process was lost. The client's ``missed_heartbeat_callback``
cannot replace that handler from Python (jaxlib cannot pass the ``absl::Status`` to a Python
callable: ``std::bad_cast``, then ``terminate``).

So process 0 runs the service in a child process that outlives it: when process 0 dies the
service keeps answering, and each survivor's ``PeerWatch`` sees process 0's heartbeat
stand still and ends its process with one line (``lost process 0``) within half of the
heartbeat timeout, before the service itself declares the loss at the full timeout.

The host holds no device and imports only jaxlib's extension. It ignores SIGINT and SIGTERM
(a Ctrl-C or a scheduler's TERM is for the trainers, which stop at a step boundary and still
need the service), and ends when process 0 says the run is over (``done`` on its stdin, after
JAX's shutdown barrier) or, when process 0 vanished without saying it, ``linger_s`` later.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

READY = "ready"
DONE = "done"


class HostedService:
    """What ``jax.distributed`` keeps as its service: ``shutdown()`` ends the host."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc

    @classmethod
    def start(cls, address: str, num_nodes: int, linger_s: float, **kwargs) -> HostedService:
        command = [sys.executable, "-m", __name__, address, str(num_nodes), str(linger_s)]
        command.append(encode(kwargs))
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # the service's own log lines (``coordination_service.cc``: tasks unhealthy) would
            # land in the job's output under srun, after the one line the survivors print;
            # a failure to start still reaches process 0, on stdout
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C reaches the trainers, not the host
        )
        line = proc.stdout.readline().strip()
        if line != READY:
            proc.kill()
            raise RuntimeError(f"the coordination service did not start on {address}: {line}")
        return cls(proc)

    def shutdown(self) -> None:
        """The run is over (every process passed JAX's shutdown barrier): end the host."""
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.write(DONE + "\n")
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


@contextlib.contextmanager
def service_in_own_process(linger_s: float):
    """While process 0 joins, JAX's ``get_distributed_runtime_service`` starts a host
    process (``HostedService``) instead of a service inside this one. JAX builds the service
    inside ``initialize`` with no way to choose where, so its module's reference to the
    extension is swapped for a proxy for the duration, then restored."""
    from jax._src import distributed as _dist

    lib = getattr(_dist, "_jax", None)
    if lib is None or not hasattr(lib, "get_distributed_runtime_service"):
        yield  # a JAX laid out otherwise: it hosts the service itself, as before
        return

    class Hosted:
        def __getattr__(self, name):
            return getattr(lib, name)

        @staticmethod
        def get_distributed_runtime_service(address, num_nodes, **kwargs):
            return HostedService.start(address, num_nodes, linger_s, **kwargs)

    _dist._jax = Hosted()
    try:
        yield
    finally:
        _dist._jax = lib


def encode(kwargs: dict) -> str:
    """JAX's keyword arguments for the service as one command-line word, typed (JSON): the
    binding takes ints, bools and paths, and which ones changes between releases (jax 0.12
    adds ``verify_secure_credentials``, a bool, and the mTLS paths; an int in its place is
    refused). Unset ones (None) are left to the binding's defaults."""
    return json.dumps({k: v for k, v in kwargs.items() if v is not None})


def decode(word: str) -> dict:
    """``encode``'s keyword arguments, as JAX passed them."""
    return json.loads(word)


def _serve(argv: list[str]) -> None:
    address, num_nodes, linger_s = argv[0], int(argv[1]), float(argv[2])
    kwargs = decode(argv[3]) if len(argv) > 3 else {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from jax._src.lib import _jax  # the extension only: no backend starts here

    try:
        service = _jax.get_distributed_runtime_service(address, num_nodes, **kwargs)
    except Exception as err:  # e.g. the port is taken: process 0 reports it
        print(f"{type(err).__name__}: {err}".splitlines()[0], flush=True)
        return
    print(READY, flush=True)
    said = sys.stdin.readline().strip()
    if said != DONE:  # process 0 vanished: serve the survivors until they have noticed
        time.sleep(linger_s)
    else:
        service.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1:])
