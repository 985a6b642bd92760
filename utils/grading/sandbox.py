"""One submission's checking process, started in a sandbox and bounded: a time limit, a memory limit, nothing left.

    slot = Slot(workdir, seconds, memory_bytes, graded)   the checking process (utils.grading.runner), started
    slot.run(index, source, guard=(), fork=False)         one cell run there: None, or [exception name, message];
                                                          raises Stopped if the process ends first
    slot.close()                                          every process of the slot killed

On Linux with bubblewrap (`bwrap`), the process runs in a sandbox of its own (sandbox_command): the system, the
virtual environment and the course's utils/ mounted read-only (not the graded notebook's solution, not the
folders of submissions or grades: nothing of the checkout but utils/ and the other notebooks' solutions); the
submission's working folder the only writable place besides a private /tmp and /dev/shm (in memory, 1 GB at
most); no capabilities; a network of its own with only loopback (gloo needs it); and a PID namespace: when its
first process dies, the kernel kills every other one, double forks and new sessions included, and it dies with
the grader (--die-with-parent). Without bwrap (macOS, a bare container) the process runs in a session of its own
and is killed with it, after a warning that names what is not isolated (WARNING).

A watchdog thread polls the slot's processes in /proc: past the deadline, or with their resident memory summed
over the limit, it kills them all. Why not resource.setrlimit(RLIMIT_AS): torch reserves address space far beyond
what it touches, so a limit on address space that torch survives does not bound memory. Resident memory is what
exhausts a machine: summed every WATCH_SECONDS (proportional set sizes, so that pages forked ranks share count
once), it overshoots the limit by at most what is allocated in that time.
"""
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

from utils.notebooks import ROOT

WATCH_SECONDS = 0.2
COURSE = "/course"  # where the sandbox sees the course: its utils/ only
WORKDIR = "/submission"


class Stopped(Exception):
    """The checking process ended before a cell did: reason "timed out", "out of memory" or "died"."""


@functools.cache
def bwrap():
    """The bwrap command if it runs here (a container may forbid its namespaces), else None."""
    path = shutil.which("bwrap")
    if path is None or not sys.platform.startswith("linux"):
        return None
    probe = subprocess.run([path, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "true"],
                           capture_output=True)
    return path if probe.returncode == 0 else None


WARNING = ("bubblewrap (bwrap) is not available: submissions run without a sandbox. Their code can read solutions/ "
           "and other students' files, write to the course and the grades, use the network, and a process that "
           "leaves its session can outlive its submission; how an answer communicated is counted in its own processes "
           "only, where it can forge the count (on Debian or Ubuntu: apt-get install bubblewrap)")


TMPFS_BYTES = 2**30  # the private /tmp and /dev/shm: in memory, bounded so that they cannot fill the machine's


def sandbox_command(workdir, graded=None):
    """bwrap's arguments: what the checking process sees (see the module's docstring). Of solutions/, the other
    notebooks' (a check may use an earlier notebook's solution as its reference), never `graded`'s."""
    args = [bwrap(), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--cap-drop", "ALL", "--dev", "/dev", "--proc", "/proc",
            "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--size", str(TMPFS_BYTES), "--tmpfs", "/dev/shm"]
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):  # the venv, and the Python it was made from
        if not prefix.startswith("/usr"):
            args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", str(ROOT / "utils"), f"{COURSE}/utils", "--bind", str(workdir), WORKDIR,
             "--chdir", WORKDIR, "--dir", f"{COURSE}/solutions"]
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        if path.stem != graded:
            args += ["--ro-bind", str(path), f"{COURSE}/solutions/{path.name}"]
    return args


def session_processes(sid):
    """The live processes (not zombies) of session `sid`, from /proc."""
    return [pid for pid, stat in _stats() if int(stat[3]) == sid]


def namespace_processes(ns):
    """The live processes of the PID namespace `ns` (its /proc/<pid>/ns/pid link)."""
    found = []
    for pid, _ in _stats():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == ns:
                found.append(pid)
        except OSError:
            pass
    return found


def _stats():
    """(pid, [state, ppid, pgrp, session, ...]) of every live process."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] not in "ZX":
                yield int(entry.name), fields


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


def kill_all(processes, seconds=10.0):
    """SIGKILL every process processes() lists until none is left (one that forks without end forks between two
    signals)."""
    deadline = time.monotonic() + seconds
    while (pids := processes()) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


class Slot:
    """The checking process of one submission's run, in `workdir` (see the module's docstring)."""

    WARNING = WARNING

    def __init__(self, workdir, seconds, memory_bytes=None, graded=None):
        self.deadline, self.memory_bytes, self.reason = time.monotonic() + seconds, memory_bytes, None
        read_end, write_end = os.pipe()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GRADING_REPORT_FD": str(write_end),
               "GRADING_SLOT": str(workdir),  # by which a test finds the slot's processes
               "LANG": "C.UTF-8", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        python = [sys.executable, "-P", "-m", "utils.grading.runner"]
        if bwrap():
            env.update(PYTHONPATH=COURSE, HOME="/tmp", TMPDIR="/tmp", GRADING_WIRE="1")  # its own network
            command, cwd = sandbox_command(workdir, graded) + python, None
        else:
            env.update(PYTHONPATH=str(ROOT), HOME=str(workdir), TMPDIR=str(workdir))
            command, cwd = python, workdir
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, pass_fds=(write_end,), start_new_session=True,
                                        text=True)
        os.close(write_end)
        self.reports = os.fdopen(read_end, "r")
        self.namespace, self.wire = None, {}  # {cell index: TCP segments its ranks sent (utils.grading.wire)}
        self.watchdog = threading.Thread(target=self._watch, daemon=True)
        self.done = threading.Event()
        self.watchdog.start()

    def processes(self):
        """The slot's live processes: its PID namespace's (bwrap), or its session's."""
        if not bwrap():
            return session_processes(self.process.pid)
        if self.namespace is None:
            inside = [pid for pid, stat in _stats() if int(stat[1]) == self.process.pid]
            if not inside:
                return [self.process.pid] if self.process.poll() is None else []
            try:
                self.namespace = os.readlink(f"/proc/{inside[0]}/ns/pid")
            except OSError:
                return []
        return namespace_processes(self.namespace) + ([self.process.pid] if self.process.poll() is None else [])

    def _watch(self):
        while not self.done.wait(WATCH_SECONDS):
            if time.monotonic() > self.deadline:
                self.reason = "timed out"
            elif self.memory_bytes and resident_bytes(self.processes()) > self.memory_bytes:
                self.reason = "out of memory"
            if self.reason:
                kill_all(self.processes)
                return

    def run(self, index, source, guard=(), fork=False):
        """Run one cell (in a fork of the checking process if `fork`); None if it ended without an exception, else
        [its name, its message]."""
        try:
            self.process.stdin.write(json.dumps({"index": index, "source": source, "guard": list(guard),
                                                 "fork": fork}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process is gone: the report says so
        while True:
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([self.reports], [], [], max(0.0, min(left + 1, WATCH_SECONDS * 5)))
            if ready:
                line = self.reports.readline()
                if not line:
                    self.done.set()
                    self.watchdog.join()
                    raise Stopped(self.reason or "died")
                report = json.loads(line)
                if report["index"] == index:
                    self.wire[index] = report.get("wire")
                    return report["error"]
            elif left < -5:  # the watchdog has killed it: its pipe closes
                raise Stopped(self.reason or "timed out")

    def close(self):
        self.done.set()
        try:
            self.process.stdin.close()
        except OSError:
            pass
        kill_all(self.processes)
        try:
            self.process.kill()
        except ProcessLookupError:
            pass
        self.process.wait()
        self.reports.close()
