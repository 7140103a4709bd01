"""`hybridmoe launch --processes N -- <command> ...`: one machine, N processes of one distributed run.

Each process is `python -m hybridmoe <command> ...` with the mesh.* keys of a distributed run added
(coordinator on a free local port, its process id), so it runs exactly the code path of one process
per host on a TPU pod or a SLURM cluster, where the cluster supplies those values instead. With
mesh.cpu_devices each process simulates that many CPU devices. When one process dies the others
would wait in a collective for ever: the launcher stops them and exits with the failure.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_argv(argv: list[str], processes: int, process_id: int, port: int) -> list[str]:
    return [sys.executable, "-m", "hybridmoe", *argv, "mesh.distributed=true",
            f"mesh.coordinator_address=127.0.0.1:{port}", f"mesh.num_processes={processes}",
            f"mesh.process_id={process_id}"]


def launch(argv: list[str], processes: int, port: int = 0, poll_s: float = 0.1) -> int:
    """Run the processes to the end; the exit status of the first to fail, else 0."""
    port = port or free_port()
    # Process 0 speaks for the run (metrics, progress, summaries); the others' stdout is dropped,
    # their stderr kept (an error names its process).
    procs = [subprocess.Popen(process_argv(argv, processes, i, port), stdout=None if i == 0 else subprocess.DEVNULL)
             for i in range(processes)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                print(f"hybridmoe launch: process {i} exited with status {code}; stopping the others",
                      file=sys.stderr)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
