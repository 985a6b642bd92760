"""Start ranks: `spawn(fn, world_size)` runs `fn(rank, world_size)` on `world_size` processes.

The one way the course starts ranks: in a notebook, a script, a test, or under torchrun.

Why not `torch.multiprocessing.spawn`? It ships `fn` by reference, so a function defined in a
notebook cell never reaches the children; it starts every child with the `spawn` method (seconds
per call); the children's prints bypass the notebook; and a rank that skips a collective hangs
for the default 30 minutes. Here instead:

- `fn` travels by value (cloudpickle): notebook functions, lambdas and closures all work;
- ranks are forked on Linux (a fraction of a second) and spawned elsewhere (fork is unsafe on macOS):
  warm, after the first call (see "Warm ranks" below);
- ranks meet through a FileStore in a temporary folder: no port to pick or collide on, nothing
  listens on the network, and gloo's own sockets stay on the loopback interface;
- each rank's stdout and stderr go to files that the caller prints afterwards, in rank order,
  each line prefixed `[rank R] `;
- a rank that raises ends the call within seconds with that rank's traceback; a rank that stalls
  ends it after `timeout` seconds with where every unfinished rank was stuck.

Warm ranks (the spawn start method: macOS, or SPAWN_START_METHOD=spawn). A spawned rank is a new
Python that imports torch: about 3 s for every call, and the notebooks launch dozens of times. Two
ways to pay that once were measured here (2 cores, Linux, SPAWN_START_METHOD=spawn, a 4-rank call
that joins a gloo group, all-reduces one number and leaves; benchmarks/launch_overhead.py):

- a pool of warm rank processes, kept between calls, each call shipping fn to them: fast, but
  everything a call leaves behind in a process (module state, a patched torch.distributed function,
  RNG state, environment variables, the default dtype, a library file edited in between) would
  reach the next call, and each of those must be undone by hand, forever;
- multiprocessing's `forkserver` with torch preloaded: one fresh Python (the server) imports torch
  once and runs no user code; each rank of each call is a fork of it. Every call starts from the
  same clean state by construction, `utils` is imported fresh by every rank (an edited file is
  seen), and the server exits with its caller (it reads a pipe from it: EOF once the caller is gone,
  even killed with SIGKILL, and its ranks, which watch the caller, have exited).

Measured side by side in one run (benchmarks/launch_overhead.py; median of 5 calls after a first):
fork 0.046 s; warm 0.070 s (its first call 1.2 s: the server imports torch); a warm pool 0.059 s;
cold spawn 2.59 s; torch.multiprocessing.spawn 3.85 s. The pool is faster by a fork per rank, and
would be paid for with everything above; the forkserver is what `spawn` does with the spawn start
method. The server's one listener is a Unix-domain socket in a private temporary folder (no network
port). Turn warm ranks off with `warm=False` or SPAWN_WARM=0: every call then spawns afresh.

What a rank imports on first use, it imports again in every call: a forked rank starts from the caller's
modules. So a module torch loads lazily and slowly is imported by the course module that needs it, on the
caller's side (a module ranks do not import, or one every caller of that kind imports), and forks inherit it:
torch._dynamo in utils.model (every optimizer loads it: 1 s), torch.distributed.optim in utils.checks.fsdp
(0.9 s), torch.distributed.pipelining in utils.checks.pipeline (0.1 s). Not here before every fork: a notebook
that makes no optimizer would pay for torch._dynamo. Warm ranks get the same: the forkserver, when it starts,
imports those of these modules (LAZY_IMPORTS) that the caller has imported; notebook 00, which has none, starts
its server in half the time.
"""
import atexit
import contextlib
import datetime
import faulthandler
import io
import linecache
import multiprocessing as mp
import operator
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from multiprocessing.connection import wait as wait_for_any

import cloudpickle
import torch
import torch.distributed as dist

START_METHOD_ENV = "SPAWN_START_METHOD"
WARM_ENV = "SPAWN_WARM"
# What the forkserver imports, so that its forks (the warm ranks) start with it: never utils (an edited file must be
# seen); and of the modules torch loads lazily and slowly (the opening comment), those the caller has imported.
PRELOAD = ["torch", "torch.distributed", "cloudpickle"]
LAZY_IMPORTS = ["torch._dynamo", "torch.distributed.optim", "torch.distributed.pipelining"]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("gloo", "nccl")
STARTUP_SECONDS = 60.0  # to start the ranks and join the group; `timeout` counts from there
FRAME = re.compile(r'File "(.*)", line (\d+) in (.*)')  # a frame in a faulthandler dump
PEER_LEFT = re.compile(r"Connection (reset|closed) by peer")  # gloo, when the other end of a pair has exited


class RankError(RuntimeError):
    """A rank raised an exception or died. `rank` is the first rank that failed."""

    def __init__(self, rank, world_size, summary, details=""):
        self.rank, self.summary = rank, summary
        message = f"rank {rank} of {world_size} failed: {summary}"
        super().__init__(message + (f"\n\n{details}" if details else ""))


def spawn(fn, world_size, *args, backend="gloo", timeout=60.0, start_method=None, warm=None, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    The default process group is ready when `fn` starts and destroyed when it returns. The
    result is the list of return values in rank order. `timeout` counts from the moment every
    rank has joined the group (starting up has its own STARTUP_SECONDS). Under torchrun, `fn`
    runs on the ranks torchrun started (in this process) and every rank gets the whole list.
    With the spawn start method, `warm` (default: on, unless $SPAWN_WARM is 0) forks the ranks from
    a server that has imported torch once.
    """
    check_arguments(fn, world_size, backend, timeout, start_method, warm)
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout)
    if backend == "nccl" and start_method is None:
        start_method = "spawn"  # CUDA does not survive fork
    threads = threads_per_rank(world_size)
    context = rank_context(resolve_start_method(start_method), warm, threads)
    return _run_local(fn, world_size, args, kwargs, backend, timeout, context, threads)


# ---------------------------------------------------------------- arguments and environment

def check_arguments(fn, world_size, backend="gloo", timeout=60.0, start_method=None, warm=None):
    """Fail before any process starts, with a message that says what to change."""
    if not callable(fn):
        raise TypeError(f"spawn: fn must be a function taking (rank, world_size, ...), got {type(fn).__name__}")
    if isinstance(world_size, bool) or not hasattr(type(world_size), "__index__"):
        raise TypeError(f"spawn: world_size must be an int, got {world_size!r}")
    if operator.index(world_size) < 1:
        raise ValueError(f"spawn: world_size must be at least 1, got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"spawn: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl":
        needed = 1 if under_torchrun() else world_size
        if torch.cuda.device_count() < needed:
            raise ValueError(f"spawn: backend='nccl' needs {needed} GPU(s) on this machine, found "
                             f"{torch.cuda.device_count()}; use backend='gloo' on CPU")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"spawn: timeout must be a number of seconds, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"spawn: timeout must be positive, got {timeout}")
    if start_method is not None:
        resolve_start_method(start_method)
    if warm is not None and not isinstance(warm, bool):
        raise TypeError(f"spawn: warm must be True, False or None (the default: ${WARM_ENV}, else on), got {warm!r}")


def resolve_start_method(start_method=None):
    """fork on Linux (fast); spawn elsewhere; `start_method` or $SPAWN_START_METHOD overrides."""
    default = "fork" if sys.platform.startswith("linux") else "spawn"
    method = start_method or os.environ.get(START_METHOD_ENV) or default
    methods = [m for m in ("fork", "spawn") if m in mp.get_all_start_methods()]  # forkserver: the
    if method not in methods:  # ranks' parent would be the server, and they watch their parent
        raise ValueError(f"spawn: start method must be one of {methods}, got {method!r}")
    return method


def warm_ranks(warm=None):
    """Whether spawned ranks are forked from a warm server: `warm` if given, else $SPAWN_WARM (default on)."""
    if warm is not None:
        return warm
    return os.environ.get(WARM_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def rank_context(start_method, warm=None, threads=1):
    """The multiprocessing context that starts ranks of `threads` threads each: fork; spawn; or, for spawn with
    warm ranks, a forkserver that has imported torch once (see the module's opening comment).

    A forked rank must not use more than one thread: GNU OpenMP's thread pool does not survive fork, and
    a rank forked from a caller that has used it hangs in its first parallel op. So when each rank gets
    several threads (fewer ranks than cores), the ranks are not forked from the caller but started like
    spawned ones: from the warm forkserver (which never runs a parallel op), or fresh. A rank of one thread
    never enters an OpenMP parallel region (ATen runs the loop inline), so it is forked."""
    if start_method == "fork" and threads > 1:
        start_method = "spawn"
    if start_method == "spawn" and warm_ranks(warm):
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD + [name for name in LAZY_IMPORTS if name in sys.modules])
        return context
    return mp.get_context(start_method)


def under_torchrun():
    return all(name in os.environ for name in TORCHRUN_ENV)


def apart(fn, *args, timeout=60.0):
    """fn(0, 1, *args) in a process of its own (a rank of one, as spawn starts it, but with one thread), its result
    returned: the caller runs none of fn's code (the grader's checks: utils/grading). One thread, because a rank of
    one thread is forked (rank_context): a rank with the cores to itself is not, and a notebook whose first launch
    is a check's would pay 3 s to start the warm server. Under torchrun, which starts every rank, each rank calls fn
    itself."""
    if under_torchrun():
        return fn(0, 1, *args)
    check_arguments(fn, 1, timeout=timeout)
    context = rank_context(resolve_start_method(), threads=1)
    return _run_local(fn, 1, args, {}, "gloo", timeout, context, threads=1)[0]


def runnable_world_sizes(world_sizes):
    """The world sizes spawn can start here: all of them, or under torchrun only torchrun's own."""
    return [int(os.environ["WORLD_SIZE"])] if under_torchrun() else list(world_sizes)


def usable_cores():
    """The cores this process may run on (its affinity on Linux; all of them on macOS)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_rank(world_size):
    """Share the cores: 4 ranks on 2 cores with 2 threads each would fight over them."""
    return max(1, usable_cores() // world_size)


def loopback_interface():
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS), for GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), next((n for n in names if n.startswith("lo")), None))


# ---------------------------------------------------------------- under torchrun

def _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout):
    torchrun_world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world_size != torchrun_world_size:
        raise ValueError(f"spawn: world_size={world_size} but torchrun started {torchrun_world_size} "
                         f"ranks; pass world_size=int(os.environ['WORLD_SIZE'])")
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_leave_together)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            result = fn(rank, world_size, *args, **kwargs)
    except BaseException:
        _print_prefixed(output.getvalue(), rank, sys.stdout)
        atexit.unregister(_leave_together)  # its barrier would wait for ranks that may be waiting for this one
        raise
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (output.getvalue(), result))
    if rank == 0:  # every rank's lines once, in rank order, as in a notebook
        for r, (text, _) in enumerate(gathered):
            _print_prefixed(text, r, sys.stdout)
    return [r for _, r in gathered]


def _leave_together():
    """At the script's end: wait for every rank, then tear the group down. A rank that destroys its group while
    a peer is still talking to it can make gloo abort the peer ('terminate called without an active exception',
    seen about once in 15 torchrun runs of notebook 02 with 4 ranks)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------- local processes

def _run_local(fn, world_size, args, kwargs, backend, timeout, context, threads):
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(f"spawn: cannot send fn and its arguments to the ranks: {e}") from e
    rundir = tempfile.mkdtemp(prefix="spawn-")
    procs, ready = [], []
    try:
        sys.stdout.flush()  # or a forked child could print the parent's pending output again
        sys.stderr.flush()
        with warnings.catch_warnings(), _without_main():  # Python >= 3.12 warns on fork from a threaded
            warnings.simplefilter("ignore", DeprecationWarning)  # process (Jupyter); ranks use no parent thread
            for rank in range(world_size):
                ready_receiver, ready_sender = context.Pipe(duplex=False)
                ready.append(ready_receiver)
                proc = context.Process(
                    target=_rank_main, name=f"rank {rank}",
                    args=(rank, world_size, threads, backend, timeout, payload, rundir, os.getpid(), ready_sender))
                try:
                    proc.start()
                finally:
                    ready_sender.close()  # the rank holds the only sender: its exit closes the pipe
                procs.append(proc)  # only started processes: the cleanup joins every one of them
        outcome, ranks = _wait(procs, ready, rundir, timeout)
        if outcome == "stalled":
            where = _where_stuck(procs, ranks, rundir)
            raise TimeoutError(_stall_message(ranks, world_size, timeout, where))
        if outcome == "failed":
            _wait_for_a_dying_peer(procs, rundir, ranks)
            raise _first_failure(procs, rundir, killed=_stop(procs))
        return [_read_report(rundir, rank)[1] for rank in range(world_size)]
    finally:  # after success, failure, timeout or Ctrl-C: no rank outlives the call
        _stop(procs)
        _print_outputs(rundir, len(procs))
        shutil.rmtree(rundir, ignore_errors=True)


@contextlib.contextmanager
def _without_main():
    """Start the ranks without the caller's __main__: they get fn by value and need nothing from it, and a
    spawned rank would import it again (in Jupyter, the kernel's launcher: about half a second per rank)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


DYING = ("terminate called", "Fatal Python error")  # a C++ abort (gloo's), then faulthandler's dump


def _wait_for_a_dying_peer(procs, rundir, failed, seconds=5.0):
    """A rank whose peer died reports at once ("Connection reset by peer"), while the peer may still be dying: gloo's
    abort writes its reason, then faulthandler every thread's stack, slowly on a loaded machine. Killing it then
    would hide the cause behind its echo: a rank still running that has begun to die (DYING in its stderr) gets up
    to `seconds` to end on its own. A rank merely stuck is not waited for."""
    report = _read_report(rundir, failed[0])
    if report[0] != "error" or not PEER_LEFT.search(report[2]):
        return
    deadline = time.monotonic() + seconds
    while (dying := [p.sentinel for rank, p in enumerate(procs) if p.is_alive() and _dying(rundir, rank)]) \
            and time.monotonic() < deadline:
        wait_for_any(dying, timeout=max(0.0, deadline - time.monotonic()))


def _dying(rundir, rank):
    with contextlib.suppress(FileNotFoundError), open(os.path.join(rundir, f"{rank}.err"), errors="replace") as f:
        return any(words in f.read() for words in DYING)
    return False


def _stop(procs):
    """Kill the ranks still running; return their numbers."""
    killed = {rank for rank, p in enumerate(procs) if p.is_alive()}
    for rank in killed:
        procs[rank].kill()
    for p in procs:
        p.join()
    return killed


def _wait(procs, ready, rundir, timeout):
    """Wait until all ranks finish ("ok"), one fails ("failed") or time runs out ("stalled").

    The clock starts once every rank has joined the group (a message on its `ready` pipe):
    with the spawn start method, importing torch alone can take seconds.
    """
    deadline = time.monotonic() + STARTUP_SECONDS + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    starting = {conn: rank for rank, conn in enumerate(ready)}
    while running:
        events = wait_for_any([*running, *starting], timeout=max(0.0, deadline - time.monotonic()))
        if not events:
            return "stalled", sorted(running.values())
        for event in events:
            if event in starting:
                del starting[event]  # joined (or died, which the sentinel reports)
                if not starting:
                    deadline = time.monotonic() + timeout
                continue
            rank = running.pop(event)
            procs[rank].join()
            # The report, not the exit code, says how fn ended: a rank forked from a thread-pool
            # worker exits with code 1 after a clean run (Python's exit hook joins the pool).
            if _read_report(rundir, rank)[0] != "ok":
                return "failed", [rank]
    return "ok", []


def _rank_main(rank, world_size, threads, backend, timeout, payload, rundir, caller_pid, ready):
    """The body of one rank's process: capture output, join the group, run fn, report."""
    _capture_output(rundir, rank)
    faulthandler.enable(file=sys.stderr)  # a crash dumps this rank's Python stack into its own stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the caller, which stops every rank
    _exit_with_caller(caller_pid)
    stack_file = open(os.path.join(rundir, f"{rank}.stack"), "w")
    stack_file.write(f"main thread {threading.get_ident():#x}\n")
    stack_file.flush()
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # for _where_stuck
    torch.set_num_threads(threads)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and loopback_interface():
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    try:
        fn, args, kwargs = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(rundir, "store"), world_size)
        # The caller enforces `timeout`; gloo's own limit only has to be longer.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=STARTUP_SECONDS + timeout))
        dist.barrier()  # every rank has finished connecting before any can return and hang up
        ready.send(rank)
        ready.close()
        result = fn(rank, world_size, *args, **kwargs)
        # No destroy_process_group(): the process exits right after the report, and destroying gloo's group
        # costs 20-40 ms a rank, a third of a trivial call.
        report = cloudpickle.dumps(("ok", result))
    except BaseException as e:
        report = _error_report(e)
    _write_report(rundir, rank, report)
    sys.stdout.flush()
    sys.stderr.flush()
    # Without Python's teardown: a forked rank skips it anyway (multiprocessing ends it with os._exit), but a
    # spawned one (warm=False) would run it, and destroying gloo's group with its threads still running aborts
    # the process ("terminate called without an active exception") after a successful call.
    os._exit(0)


def _capture_output(rundir, rank):
    """Send this process's stdout and stderr (Python and C level) to files in rundir."""
    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(rundir, f"{rank}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


def _exit_with_caller(caller_pid):
    """If the caller dies (a killed kernel), its ranks must not linger. A forked or spawned rank's parent is
    the caller; a warm rank's is the forkserver, which its ranks keep alive (they inherit the end of the
    pipe that tells it its clients are gone): so watch the caller itself too."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent and _running(caller_pid):
            time.sleep(0.2)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _running(pid):
    """Whether process `pid` exists and is not a zombie (a killed caller its own parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): kill(pid, 0) is all there is


# ---------------------------------------------------------------- reports

def _error_report(e):
    """What the caller needs to name the failure: when, what, and the traceback in fn."""
    tb = e.__traceback__.tb_next if e.__traceback__ else None  # skip _rank_main's own frame
    summary = "".join(traceback.format_exception_only(type(e), e)).strip()
    # lookup_lines=False: the caller fills in source lines, and it has the notebook's cells
    details = traceback.TracebackException(type(e), e, tb, lookup_lines=False)
    try:
        return cloudpickle.dumps(("error", time.time(), summary, details))
    except Exception:
        return pickle.dumps(("error", time.time(), summary, "".join(details.format())))


def _write_report(rundir, rank, report):
    path = os.path.join(rundir, f"{rank}.report")
    with open(path + ".tmp", "wb") as f:
        f.write(report)
    os.replace(path + ".tmp", path)  # the caller never reads half a report


def _read_report(rundir, rank):
    """("ok", result), ("error", time, summary, details), or ("none",) if the rank left none."""
    try:
        with open(os.path.join(rundir, f"{rank}.report"), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return ("none",)
    except Exception as e:
        return ("error", float("inf"), f"its return value could not be read back: {e!r}", "")


def _first_failure(procs, rundir, killed):
    """The root cause: a rank that died, else the earliest exception (not the errors it caused)."""
    died = [rank for rank in range(len(procs)) if rank not in killed and _read_report(rundir, rank)[0] == "none"]
    if died:
        rank, code = died[0], procs[died[0]].exitcode
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        last_words = ""
        with contextlib.suppress(FileNotFoundError), open(os.path.join(rundir, f"{rank}.err")) as f:
            before_crash_dump = f.read().split("Fatal Python error")[0]  # e.g. gloo's reason for aborting
            last_words = "\n".join(before_crash_dump.rstrip().splitlines()[-5:])
        details = f"The last lines it wrote to stderr (all printed above):\n{last_words}" if last_words else ""
        return RankError(rank, len(procs), f"its process {how} before fn returned", details)
    errors = [(report[1], rank, report) for rank in range(len(procs))
              if (report := _read_report(rundir, rank))[0] == "error"]
    _, rank, (_, _, summary, details) = min(errors)
    if not isinstance(details, str):
        details = "".join(details.format())
    details = details.replace("Traceback (most recent", f"Traceback from rank {rank} (most recent", 1)
    returned = [r for r in range(len(procs)) if _read_report(rundir, r)[0] == "ok"]
    if PEER_LEFT.search(summary) and returned:
        summary = _peer_left_message(rank, returned, summary)
    return RankError(rank, len(procs), summary, details.rstrip())


def _peer_left_message(rank, returned, summary):
    """gloo's words when a rank calls a collective that a peer, already gone, never made; said in the course's."""
    names = ", ".join(map(str, returned))
    return (f"it was in a collective when rank{'s' if len(returned) > 1 else ''} {names} had already returned from "
            f"fn (gloo: {PEER_LEFT.search(summary)[0]}). The ranks made different collective calls: gloo pairs "
            f"each rank's calls by their order, not by name or size, so the calls before this one may have been "
            f"paired wrongly too. Look for a collective that only some ranks make: a parameter with a gradient on "
            f"some ranks only (a branch on the data, an expert that no token reached), a loop whose length "
            f"depends on the rank")


# ---------------------------------------------------------------- output

def _print_outputs(rundir, world_size):
    for suffix, stream in (("out", sys.stdout), ("err", sys.stderr)):
        for rank in range(world_size):
            try:
                with open(os.path.join(rundir, f"{rank}.{suffix}"), encoding="utf-8", errors="replace") as f:
                    _print_prefixed(f.read(), rank, stream)
            except FileNotFoundError:
                pass
    sys.stdout.flush()


def _print_prefixed(text, rank, stream):
    for line in text.splitlines():
        print(f"[rank {rank}] {line}".rstrip(), file=stream)


# ---------------------------------------------------------------- stalls

def _where_stuck(procs, ranks, rundir, wait=10.0):
    """Ask each stalled rank for its Python stack (faulthandler on SIGUSR1); one line per rank.

    A rank writes its dump while the caller reads: wait until the main thread's part is complete (a blank
    line ends it, or the file stops growing), so that a busy machine changes how long this takes, not what
    it reports."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait
    texts, changed = dict.fromkeys(ranks, ""), time.monotonic()
    while time.monotonic() < deadline:  # the ranks write at once: read them all in each round
        time.sleep(0.01)
        for rank in ranks:
            with contextlib.suppress(FileNotFoundError), open(os.path.join(rundir, f"{rank}.stack")) as f:
                if (text := f.read()) != texts[rank]:
                    texts[rank], changed = text, time.monotonic()
        if all(_main_thread_complete(text) for text in texts.values()):
            break
        if all(_main_thread_frames(text) for text in texts.values()) and time.monotonic() - changed > 0.1:
            break  # no end mark (the main thread came last in a dump): none grew for 0.1 s
    return {rank: _innermost_user_frame(text) for rank, text in texts.items()}


def _main_thread_frames(text):
    """The (path, line, function) frames of the main thread in a faulthandler dump, innermost first, and
    whether its part of the dump has ended (a blank line follows it)."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("main thread"):
        return []
    main, frames, in_main = int(lines[0].split()[-1], 16), [], False
    for line in lines[1:]:
        if "thread 0x" in line.lower():
            in_main = int(line.split("0x", 1)[1].split()[0], 16) == main
        elif in_main and (m := FRAME.search(line)):
            frames.append((m[1], int(m[2]), m[3]))
        elif in_main and not line.strip() and frames:
            return frames + [None]  # None: the main thread's part is complete
    return frames


def _main_thread_complete(text):
    frames = _main_thread_frames(text)
    return bool(frames) and frames[-1] is None


def _innermost_user_frame(text):
    """From a faulthandler dump, the main thread's innermost frame outside torch and Python."""
    if not text.startswith("main thread"):
        return "still starting up"
    frames = [f for f in _main_thread_frames(text) if f is not None]
    library = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__), os.path.dirname(cloudpickle.__file__),
               __file__, os.path.join(os.path.dirname(__file__), "intercept.py"))
    user = [f for f in frames if not f[0].startswith(library)] or frames
    if not user:
        return "no Python stack received (the rank did not answer its stack request)"
    path, lineno, name = user[0]
    source = linecache.getline(path, lineno).strip()
    return f"in {name}(), line {lineno}" + (f": {source}" if source else "")


def _stall_message(ranks, world_size, timeout, where):
    names = ", ".join(map(str, ranks))
    lines = [f"spawn: rank{'s' if len(ranks) > 1 else ''} {names} of {world_size} did not finish "
             f"within {timeout:g} s and {'were' if len(ranks) > 1 else 'was'} stopped. Where each one was:"]
    lines += [f"  rank {rank}: {where[rank]}" for rank in ranks]
    lines.append("A rank waiting in a collective is waiting for a rank that never joined it.")
    return "\n".join(lines)
