"""Start-up rendezvous: every process of a job checks in before `jax.distributed` starts.

`jax.distributed.initialize` waits silently until every process has
connected, and when one never does, JAX ends each process after the
initialization timeout with an abort that blames "another task died". So
that a user sees who is missing, `jaxdist.initialize` first runs this
rendezvous on the coordinator's own port: process 0 listens there, every
other process connects and says which process it is, and process 0 tells
them all how many are still missing until everyone is there; then process 0
closes the port and `jax.distributed` starts on it as usual.

While waiting, each process prints to stderr, every ``report_interval``
seconds (``JAXDIST_STARTUP_REPORT_INTERVAL``, default 30; ``0`` turns the
rendezvous off and leaves start-up to JAX alone)::

    jaxdist.initialize: process 0: waiting for 1 of 2 processes to connect to
    127.0.0.1:6123 (missing: process 1; 30 s of 300 s)

and if they are not all there after ``timeout`` seconds it raises
`RuntimeError` naming the missing process ids and the address (a process
that cannot reach process 0 names process 0). The protocol is a few text
lines over TCP; only processes that run `jaxdist.initialize` take part (a
job whose processes call `jax.distributed.initialize` themselves must turn
it off).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable

__all__ = ["DEFAULT_REPORT_INTERVAL", "ENV_REPORT_INTERVAL", "rendezvous"]

ENV_REPORT_INTERVAL = "JAXDIST_STARTUP_REPORT_INTERVAL"
DEFAULT_REPORT_INTERVAL = 30.0
_GREETING = "JAXDIST-HELLO"
_RETRY = 0.2  # seconds between attempts to reach process 0
_CLIENT_GRACE = 10.0  # a client waits this much longer than process 0 for its verdict
_WHERE = "jaxdist.initialize"


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{_WHERE}: {text}\n")
        sys.stderr.flush()


def _ids(ids: list[int]) -> str:
    names = ", ".join(map(str, ids))
    return f"process {names}" if len(ids) == 1 else f"processes {names}"


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"{_WHERE}(): the coordinator address {address!r} is not HOST:PORT; give the "
            "cluster resolver an address such as '10.0.0.1:1234'."
        )
    return host.strip("[]"), int(port)


def _timeout_error(missing: list[int], n: int, address: str, timeout: float) -> RuntimeError:
    return RuntimeError(
        f"{_WHERE}(): {len(missing)} of {n} processes did not connect to {address} within "
        f"{timeout:g} s (initialization_timeout, or JAXDIST_INITIALIZATION_TIMEOUT): missing "
        f"{_ids(missing)}. Start every process of the job with the same coordinator address "
        "and process count, each with its own process id, or raise the timeout if some "
        "start late."
    )


def rendezvous(
    address: str,
    num_processes: int,
    process_id: int,
    timeout: float,
    report_interval: float,
    *,
    say: Callable[[str], None] = _say,
) -> None:
    """Returns once every process of the job has checked in (see the module docstring).

    Raises:
        RuntimeError: not every process checked in within ``timeout`` seconds
            (the message names the missing ids), or the processes disagree on
            the job (process count, duplicate ids).
    """
    if process_id == 0:
        _serve(address, num_processes, timeout, report_interval, say)
    else:
        _join(address, num_processes, process_id, timeout, report_interval, say)


def _listen(address: str) -> socket.socket:
    _, port = _host_port(address)
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")  # where JAX's service will listen
    host = _host_port(bind)[0] if bind else ""
    if not host and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server((host, port))


def _serve(
    address: str, n: int, timeout: float, interval: float, say: Callable[[str], None]
) -> None:
    start = time.monotonic()
    deadline, report = start + timeout, start + interval
    listener = _listen(address)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients: dict[int, socket.socket] = {}
    pending: dict[socket.socket, bytes] = {}  # connected, not yet said who they are
    accepted: list[socket.socket] = []  # every connection, closed at the end

    def missing() -> list[int]:
        return [i for i in range(1, n) if i not in clients]

    def tell_all(line: str) -> None:
        for sock in clients.values():
            with contextlib.suppress(OSError):
                sock.sendall(line.encode() + b"\n")

    def fail(error: RuntimeError, line: str) -> RuntimeError:
        tell_all(line)
        return error

    try:
        while missing():
            now = time.monotonic()
            if now >= deadline:
                ids = missing()
                error = _timeout_error(ids, n, address, timeout)
                raise fail(error, f"TIMEOUT {','.join(map(str, ids))}")
            if now >= report:
                ids = missing()
                say(
                    f"process 0: waiting for {len(ids)} of {n} processes to connect to "
                    f"{address} (missing: {_ids(ids)}; {now - start:.0f} s of {timeout:g} s)"
                )
                tell_all(f"WAITING {','.join(map(str, ids))}")
                report += interval
            for key, _ in selector.select(max(0.0, min(deadline, report) - now)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    conn, _ = listener.accept()
                    accepted.append(conn)
                    pending[conn] = b""
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                data = b""
                with contextlib.suppress(OSError):
                    data = sock.recv(4096)
                if sock in pending and data:
                    pending[sock] += data
                    if b"\n" not in pending[sock]:
                        continue
                    line = pending.pop(sock).split(b"\n", 1)[0].decode(errors="replace")
                    refusal = _check_in(line, n, clients)
                    if refusal is not None:
                        with contextlib.suppress(OSError):
                            sock.sendall(f"ERROR {refusal}\n".encode())
                        raise fail(RuntimeError(refusal), f"ERROR {refusal}")
                    clients[int(line.split()[1])] = sock
                    if missing():
                        tell_all(f"WAITING {','.join(map(str, missing()))}")
                    continue
                # A process went away before everyone was there (or sent more than asked).
                selector.unregister(sock)
                pending.pop(sock, None)
                for i, known in list(clients.items()):
                    if known is sock:
                        del clients[i]
                        tell_all(f"WAITING {','.join(map(str, missing()))}")
                sock.close()
        tell_all("GO")
        # The others close first, so that the port is free for JAX's service at once.
        end = time.monotonic() + 5.0
        while clients and time.monotonic() < end:
            for key, _ in selector.select(0.1):
                sock = key.fileobj
                if sock is not listener and isinstance(sock, socket.socket):
                    with contextlib.suppress(OSError):
                        if sock.recv(4096):
                            continue
                    for i, known in list(clients.items()):
                        if known is sock:
                            del clients[i]
    finally:
        for sock in accepted:
            sock.close()
        selector.close()
        listener.close()


def _check_in(line: str, n: int, clients: dict[int, socket.socket]) -> str | None:
    """Why process 0 refuses the check-in ``line``, or ``None`` when it is fine."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != _GREETING or not all(p.isdigit() for p in parts[1:]):
        return (
            f"{_WHERE}(): a program that is not jaxdist.initialize connected to process 0 "
            f"during start-up (it sent {line[:40]!r}). Start every process through "
            f"jaxdist.initialize, or set {ENV_REPORT_INTERVAL}=0 in every process."
        )
    process_id, count = int(parts[1]), int(parts[2])
    if count != n:
        return (
            f"{_WHERE}(): process {process_id} was started for {count} processes, process 0 "
            f"for {n}. Start every process with the same process count."
        )
    if not 0 < process_id < n or process_id in clients:
        return (
            f"{_WHERE}(): two processes claim process id {process_id} (of {n}). Give each "
            "process its own id, from 0 to the process count - 1."
        )
    return None


def _join(
    address: str, n: int, process_id: int, timeout: float, interval: float,
    say: Callable[[str], None],
) -> None:  # fmt: skip
    start = time.monotonic()
    deadline, report = start + timeout, start + interval
    host, port = _host_port(address)
    sock: socket.socket | None = None
    while sock is None:
        try:
            sock = socket.create_connection((host, port), timeout=max(_RETRY, 1.0))
        except OSError:
            now = time.monotonic()
            if now >= deadline:
                raise RuntimeError(
                    f"{_WHERE}(): process {process_id} could not reach process 0 (the "
                    f"coordinator) at {address} within {timeout:g} s (initialization_timeout, "
                    "or JAXDIST_INITIALIZATION_TIMEOUT): missing process 0. Start process 0, "
                    "and check that this address reaches its machine and port."
                ) from None
            if now >= report:
                say(
                    f"process {process_id}: waiting for process 0 (the coordinator) to listen "
                    f"at {address} ({now - start:.0f} s of {timeout:g} s)"
                )
                report += interval
            time.sleep(_RETRY)
    with sock:
        sock.sendall(f"{_GREETING} {process_id} {n}\n".encode())
        missing: list[int] = []
        buffer = b""
        while True:
            now = time.monotonic()
            if now >= deadline + _CLIENT_GRACE:
                if not missing:
                    raise RuntimeError(
                        f"{_WHERE}(): process 0 at {address} took the connection of process "
                        f"{process_id} but did not answer within {timeout:g} s: is the address "
                        "that of another program?"
                    )
                raise _timeout_error(missing, n, address, timeout)
            if now >= report:
                say(
                    f"process {process_id}: waiting for {len(missing)} of {n} processes to "
                    f"connect to {address} (missing: {_ids(missing)}; {now - start:.0f} s of "
                    f"{timeout:g} s)"
                    if missing
                    else f"process {process_id}: connected to process 0 at {address}, waiting "
                    f"for its word ({now - start:.0f} s of {timeout:g} s)"
                )
                report += interval
            sock.settimeout(max(0.01, min(deadline + _CLIENT_GRACE, report) - now))
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                raise RuntimeError(
                    f"{_WHERE}(): process 0 at {address} closed the connection before every "
                    f"process connected (it failed or stopped: see its output)."
                )
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                word, _, rest = line.decode(errors="replace").partition(" ")
                if word == "GO":
                    return
                ids = [int(i) for i in rest.split(",") if i.isdigit()]
                if word == "WAITING":
                    missing = ids
                elif word == "TIMEOUT":
                    raise _timeout_error(ids, n, address, timeout)
                elif word == "ERROR":
                    raise RuntimeError(rest)
