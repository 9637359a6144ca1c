"""Who may join a run: process 0 answers that question *before* anyone reaches its coordinator.

JAX's coordination service treats a second ``RegisterTask`` for a task id it already knows
as that task restarting and aborts every process of the job. So a process of another job
started on the same ``--coordinator`` (a copied command line, a reused port) kills a healthy
run the moment it joins, and any check made after joining comes too late.

Process 0 therefore opens a *join desk* on the coordinator's port + 1 before it starts the
coordinator. Every other process reads the desk first and joins only if the desk names its
job and says the run is still forming; otherwise it stops with one line and never touches
the coordinator. The desk speaks one JSON line and closes: nothing to negotiate, nothing to
hang on.
"""

from __future__ import annotations

import json
import socket
import threading
import time

from shardlib.core.errors import ShardingError

SERVICE = "shardlib-join"
ANSWER_BYTES = 4096


def desk_address(coordinator: str) -> tuple[str, int]:
    """``host:port`` of the coordinator -> (host, port + 1) of its join desk."""
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port) + 1


class JoinDesk:
    """Process 0's desk: answers ``{"service", "job", "running"}`` to whoever connects."""

    def __init__(self, coordinator: str, job_id: str | None) -> None:
        self.job_id = job_id or ""
        self.running = False
        """True once every process has joined: from then on nobody else may join."""
        _, port = desk_address(coordinator)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("0.0.0.0", port))
        except OSError as err:
            self._sock.close()
            raise ShardingError(
                f"distributed: port {port} (the coordinator's port + 1, where process 0 tells "
                f"joining processes which job runs there) is in use ({err.strerror}). Fix: "
                "start the job with a --coordinator port whose next port is free too."
            ) from None
        self._sock.listen(16)
        threading.Thread(target=self._serve, name="shardlib-join-desk", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            answer = {"service": SERVICE, "job": self.job_id, "running": self.running}
            with conn:
                try:
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()


def _read_desk(host: str, port: int) -> dict | None:
    try:
        with socket.create_connection((host, port), timeout=1.0) as conn:
            conn.settimeout(1.0)
            data = b""
            while not data.endswith(b"\n") and len(data) < ANSWER_BYTES:
                chunk = conn.recv(ANSWER_BYTES)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    try:
        answer = json.loads(data)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and answer.get("service") == SERVICE else None


def ask_to_join(
    coordinator: str,
    job_id: str | None,
    process_id: int,
    timeout_s: float,
    port_fix: str = "--coordinator HOST:PORT",
) -> None:
    """Processes > 0: wait for process 0's desk, then join only a forming run of our job.

    ``port_fix``: how this job is given another coordinator port (a flag, or under a
    launcher ``JAX_COORDINATOR_PORT``), named in the refusals."""
    host, port = desk_address(coordinator)
    deadline = time.monotonic() + timeout_s
    while (answer := _read_desk(host, port)) is None:
        if time.monotonic() > deadline:
            raise ShardingError(
                f"distributed: could not join the run at {coordinator} within {timeout_s:g} s: "
                f"no shardlib process 0 answers at port {port}. Fix: start process 0 with the "
                "same --coordinator, on a port no other program uses (nor the next one)."
            )
        time.sleep(0.25)
    mine = job_id or ""
    if answer["job"] != mine:
        raise ShardingError(
            f"distributed: the coordinator at {coordinator} runs job {answer['job'] or '(none)'}"
            f", but this process was started for job {mine or '(none)'}; it did not join, and "
            f"that job is untouched. Fix: give every job its own coordinator port ({port_fix})."
        )
    if answer["running"]:
        raise ShardingError(
            f"distributed: the run at {coordinator} already has all its processes; this process "
            f"(process {process_id}) did not join, and that run is untouched. Fix: give every "
            f"job its own coordinator port ({port_fix}) and --job-id."
        )
