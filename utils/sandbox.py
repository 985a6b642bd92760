"""Run a notebook in its own kernel, bounded: a time limit, a memory limit, and no process left behind.

    run_bounded(nb, seconds, memory_bytes) -> (why it stopped early or None, the cell it stopped at)

The grader (utils.grade) runs each submission so. The kernel starts in a session of its own (jupyter_client
starts it with start_new_session); every rank, forkserver and grandchild it starts is in that session unless it
leaves it on purpose (os.setsid). A watchdog thread polls the session's processes in /proc: past the deadline,
or with their resident memory summed over the limit, it SIGKILLs all of them, then again until none is left (a
process that forks without end forks between two signals). Whatever happens, the session is killed on the way out.

Why not resource.setrlimit(RLIMIT_AS) in the kernel: torch reserves address space far beyond what it touches
(a rank maps gigabytes it never uses), so a limit on address space that torch survives does not bound memory.
Resident memory is what exhausts a machine: summed over the session every WATCH_SECONDS (proportional set sizes,
so that pages forked ranks share count once), it overshoots the limit by at most what is allocated in that time.
"""
import os
import signal
import subprocess
import tempfile
import threading
import time

from utils.notebooks import ROOT, retry_kernel_start

WATCH_SECONDS = 0.2


def session_processes(sid):
    """The live processes (not zombies) of session `sid`, from /proc."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, _pgrp, session = stat[stat.rindex(")") + 2:].split()[:4]
        if int(session) == sid and state not in "ZX":
            pids.append(int(entry.name))
    return pids


def resident_bytes(pids):
    """The memory the processes hold, each shared page counted once (their Pss: forked ranks share most of torch)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration):  # gone meanwhile
            pass
    return total


def kill_session(sid, seconds=10.0):
    """SIGKILL every process of the session until none is left."""
    deadline = time.monotonic() + seconds
    while (pids := session_processes(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


class Watchdog(threading.Thread):
    """Kills the session past `deadline` (time.monotonic()) or over `memory_bytes` resident; `reason` says which."""

    def __init__(self, sid, deadline, memory_bytes):
        super().__init__(daemon=True)
        self.sid, self.deadline, self.memory_bytes = sid, deadline, memory_bytes
        self.reason, self.done = None, threading.Event()

    def run(self):
        while not self.done.wait(WATCH_SECONDS):
            if time.monotonic() > self.deadline:
                self.reason = "timed out"
            elif self.memory_bytes and resident_bytes(session_processes(self.sid)) > self.memory_bytes:
                self.reason = "out of memory"
            if self.reason:
                kill_session(self.sid)
                return


def start_kernel(client, cwd):
    """A fresh kernel for `client`, in `cwd`, with this course's utils first on its path; its own output
    (warnings, a crash's dump) goes nowhere: what a cell prints reaches the cell."""
    env = {**os.environ, "TMPDIR": cwd, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                    os.environ.get("PYTHONPATH")]))}
    client.km = client.create_kernel_manager()
    client.start_new_kernel(env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client.start_new_kernel_client()


def run_bounded(nb, seconds, memory_bytes):
    """Execute nb's cells in order, in place (errors do not stop the run: they are in the outputs). Returns
    (None, None) if every cell ran, else (reason, index of the cell that was running): reason "timed out",
    "out of memory" or "kernel died"."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    deadline = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix="grade-") as cwd:
        client = NotebookClient(nb, timeout=int(seconds) + 30, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": cwd}})
        retry_kernel_start(start_kernel)(client, cwd)
        sid = client.km.provisioner.pid  # the kernel leads its session
        watchdog = Watchdog(sid, deadline, memory_bytes)
        watchdog.start()
        stopped = (None, None)
        try:
            for index, cell in enumerate(nb.cells):
                if cell.cell_type == "code":
                    try:
                        client.execute_cell(cell, index)
                    except (DeadKernelError, CellTimeoutError, RuntimeError) as e:
                        if isinstance(e, RuntimeError) and "Kernel" not in str(e):
                            raise
                        watchdog.done.set()
                        watchdog.join()
                        stopped = (watchdog.reason or "kernel died", index)
                        break
        finally:
            watchdog.done.set()
            kill_session(sid)
            try:
                client._cleanup_kernel()
            except Exception:  # the kernel is gone already; its manager's shutdown may complain
                pass
            kill_session(sid)
    return stopped
