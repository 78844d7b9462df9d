"""A process for tests/launch/test_launch.py to start through jaxdist's launcher (no JAX).

It first prints one line ``READY {json}`` with its process id, pid, process group,
the launcher's variables and its own arguments, after setting up what the flags
ask for. Then all processes meet at a barrier on the coordinator's address (process
0 listens there, like JAX's coordinator), so every ``READY`` line is written before
any process goes on to do what the flags say (fail, sleep, ...). Works as a script
and as ``-m launch_child``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

VARIABLES = (
    "JAXDIST_COORDINATOR_ADDRESS",
    "JAXDIST_NUM_PROCESSES",
    "JAXDIST_PROCESS_ID",
    "JAXDIST_LOCAL_DEVICE_COUNT",
    "JAXDIST_RESTART_COUNT",
    "JAX_NUM_CPU_DEVICES",
    "JAX_PLATFORMS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
)


def _report_signal(signum: int, frame: FrameType | None) -> None:
    print(f"got {signal.Signals(signum).name}", flush=True)
    sys.exit(0)


def _preempted(signum: int, frame: FrameType | None) -> None:
    print(f"saved after {signal.Signals(signum).name}", flush=True)
    sys.exit(42)


def _barrier(rank: int, processes: int) -> None:
    """Returns once every process called it (process 0 serves on the coordinator's port)."""
    host, port = os.environ["JAXDIST_COORDINATOR_ADDRESS"].rsplit(":", 1)
    if rank == 0:
        with socket.create_server((host, int(port))) as server:
            server.settimeout(30)
            peers = [server.accept()[0] for _ in range(processes - 1)]
            for peer in peers:
                peer.sendall(b"go")
                peer.close()
        return
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=30) as conn:
                assert conn.recv(2) == b"go"
                return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0, help="then exit 0")
    parser.add_argument("--exit", type=int, default=None, help="exit code of --exit-rank")
    parser.add_argument("--exit-rank", type=int, default=1)
    parser.add_argument("--exit-after", type=float, default=0.3)
    parser.add_argument("--fail-first-start", action="store_true", help="rank 1 exits 3 at start 0")
    parser.add_argument(
        "--preempted-starts", type=int, default=0, help="--exit-rank exits 42 in starts 0..N-1"
    )
    parser.add_argument("--spawn", action="store_true", help="start a helper that sleeps")
    signals = ["default", "ignore", "report", "preempted"]
    parser.add_argument("--signals", choices=signals, default="default")
    parser.add_argument("--lines", type=int, default=0)
    parser.add_argument("--width", type=int, default=100)
    args, _ = parser.parse_known_args()
    rank = int(os.environ["JAXDIST_PROCESS_ID"])

    handler = {
        "default": signal.SIG_DFL,
        "ignore": signal.SIG_IGN,
        "report": _report_signal,
        "preempted": _preempted,  # as a PreemptionCheckpointHandler: save, exit 42
    }
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler[args.signals])
    helper = None
    if args.spawn:  # same process group, same stdout pipe
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    report = {
        "rank": rank,
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "helper": helper.pid if helper else None,
        "argv": sys.argv[1:],
        "env": {k: os.environ.get(k) for k in VARIABLES},
    }
    print("READY " + json.dumps(report), flush=True)
    _barrier(rank, int(os.environ["JAXDIST_NUM_PROCESSES"]))

    for i in range(args.lines):
        print(f"{rank} {i} " + "x" * args.width)
    if args.lines:
        print(f"stderr of {rank}", file=sys.stderr)
        sys.stdout.write(f"partial line of {rank}")
        sys.stdout.flush()
    if args.fail_first_start and rank == 1 and os.environ["JAXDIST_RESTART_COUNT"] == "0":
        sys.exit(3)
    if rank == args.exit_rank and int(os.environ["JAXDIST_RESTART_COUNT"]) < args.preempted_starts:
        time.sleep(args.exit_after)
        sys.exit(42)
    if args.exit is not None and rank == args.exit_rank:
        time.sleep(args.exit_after)
        sys.exit(args.exit)
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
