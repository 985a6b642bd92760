"""Contract tests for `utils.launch.spawn` (the course's one way to start ranks).

Each test's docstring starts with the number(s) of the contract bullet(s) it covers:
 1  fn(rank, world_size, *args, **kwargs) runs in world_size fresh processes with the default
    process group ready (and destroyed after); results come back in rank order; world_size=1 works
 2  fn may be a lambda, a closure or defined in __main__; tensors and kwargs pass through
 3  each rank's stdout/stderr (Python and C level) is printed by the caller afterwards, in rank
    order, every line prefixed "[rank R] ", also for a rank that failed or stalled
 4  start method: fork on Linux, $SPAWN_START_METHOD, then the start_method argument
 5  a rank that raises or dies -> RankError within seconds naming that rank and the root cause
 6  a rank that stalls -> TimeoutError after `timeout` saying where each unfinished rank was
 7  no rank outlives the call (success, error, timeout, Ctrl-C, the caller being killed)
 8  concurrent calls do not collide; nothing listens off the loopback interface
 9  each rank gets max(1, cores // world_size) intra-op threads
10  bad arguments raise TypeError/ValueError before any process starts
11  under torchrun, fn runs in the torchrun ranks themselves (tests/torchrun_spawn.py)

Functions run with start_method="spawn" are closures or lambdas (cloudpickle ships them by value).
Time bounds are generous on purpose: the machine has 2 cores and may be busy.
"""
import ipaddress
import multiprocessing
import multiprocessing.process
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import utils
import utils.launch
from utils.launch import RankError, resolve_start_method, spawn, threads_per_rank

REPO = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))


# Their spawn run is in the slow run only: it repeats the fork run's check at a cost the default run cannot pay.
SPAWN_RUN_IS_SLOW = {"test_ranks_stop_on_ctrl_c_and_when_the_caller_is_killed"}


def pytest_generate_tests(metafunc):
    """Every test of the contract runs twice: ranks forked (Linux's default) and spawned (macOS's path, with
    warm ranks); a test marked `one_start_method` runs once: it picks its start methods itself, or starts no rank."""
    if "start_method" in metafunc.fixturenames:
        chooses = metafunc.definition.get_closest_marker("one_start_method")
        spawned = pytest.param("spawn", marks=pytest.mark.slow) if metafunc.function.__name__ in SPAWN_RUN_IS_SLOW \
            else "spawn"
        metafunc.parametrize("start_method", ["fork"] if chooses else ["fork", spawned], indirect=True)


@pytest.fixture(autouse=True)
def start_method(request, monkeypatch):
    monkeypatch.setenv(utils.launch.START_METHOD_ENV, request.param)
    return request.param


# ---------------------------------------------------------------- helpers

def _exists(pid, allow_zombie=False):
    """Whether `pid` is still a process. A zombie counts as gone only if `allow_zombie`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if allow_zombie:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _still_alive(pids, grace=1.0, allow_zombie=False):
    """The pids that still exist after up to `grace` seconds."""
    deadline = time.monotonic() + grace
    while True:
        alive = [pid for pid in pids if _exists(pid, allow_zombie)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _write_pid(folder, rank):
    """Atomically write this process's pid to folder/<rank>.pid (runs inside a rank)."""
    path = Path(folder) / f"{rank}.pid"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, path)


def _read_pids(folder, world_size, wait=30.0):
    """The ranks' pids from folder/<rank>.pid, waiting up to `wait` seconds for the files."""
    deadline = time.monotonic() + wait
    while True:
        paths = [Path(folder) / f"{rank}.pid" for rank in range(world_size)]
        if all(p.exists() for p in paths):
            return [int(p.read_text()) for p in paths]
        assert time.monotonic() < deadline, f"pid files did not appear in {folder}"
        time.sleep(0.05)


def _prefixed(text, rank):
    """The lines of `text` that carry rank `rank`'s prefix, prefix removed."""
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def _stall_lines(message):
    """{rank: text} from the '  rank R: where' lines of a stall message."""
    return {int(m[1]): m[2] for m in re.finditer(r"^\s*rank (\d+): (.*)$", message, re.MULTILINE)}


def _subprocess_env():
    env = {k: v for k, v in os.environ.items() if k not in utils.launch.TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _python(code, *args):
    """argv for `python -c code args...` (run with cwd=REPO)."""
    return [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]


def _decode_proc_net_address(hex_address):
    """'0100007F:1F90' (IPv4) or 32 hex digits + ':port' (IPv6) from /proc/net/tcp{,6} -> address.

    The kernel prints the address as 32-bit words in host byte order, so packing each word back
    natively gives the address bytes in network order.
    """
    hex_ip, hex_port = hex_address.split(":")
    raw = b"".join(struct.pack("=I", int(hex_ip[i:i + 8], 16)) for i in range(0, len(hex_ip), 8))
    return ipaddress.ip_address(raw), int(hex_port, 16)


def _listening_addresses():
    """(address, port) of this process's TCP sockets in state LISTEN (runs inside a rank)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if m := re.fullmatch(r"socket:\[(\d+)\]", link):
            inodes.add(m[1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                address, port = _decode_proc_net_address(local)
                found.append((str(address), port))
    return found


def _is_loopback(address):
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


# ---------------------------------------------------------------- 1. processes and process group

def _group_info(rank, world_size):
    """Runs in a rank: the process group as fn sees it, a real all_reduce, reverse finish order."""
    info = {"pid": os.getpid(), "initialized": dist.is_initialized(), "rank": dist.get_rank(),
            "world_size": dist.get_world_size(), "args": (rank, world_size)}
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    info["sum"] = t.item()
    time.sleep((world_size - rank) * 0.1)  # rank 0 finishes last
    return info


def test_runs_fn_in_fresh_processes_with_process_group():
    """1: fn(rank, world_size) runs in world_size fresh processes with the group set up."""
    assert not dist.is_initialized()
    results = spawn(_group_info, 3)
    assert [r["args"] for r in results] == [(0, 3), (1, 3), (2, 3)]  # rank order, not finish order
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["initialized"] and r["world_size"] == 3 for r in results)
    assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]
    pids = [r["pid"] for r in results]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert not dist.is_initialized()  # the caller has no process group afterwards

    again = spawn(_group_info, 3)  # fresh processes on every call, not a pool
    assert not set(pids) & {r["pid"] for r in again}
    assert not dist.is_initialized()


def test_world_size_one():
    """1: world_size=1 works (group of one, all_reduce is the identity)."""
    [info] = spawn(_group_info, 1)
    assert info["args"] == (0, 1) and info["rank"] == 0 and info["world_size"] == 1
    assert info["initialized"] and info["sum"] == 1.0 and info["pid"] != os.getpid()
    assert not dist.is_initialized()


@pytest.mark.slow  # 10 s with fork, more with spawn: the default run's other tests make a hundred calls too
def test_fn_without_collectives_many_calls():
    """1: a fn that uses no collective and returns at once works every time (80 calls in a row).

    A rank whose fn returns at once tears down its connections; if a peer is still finishing
    init_process_group (gloo's connectFullMesh), that peer fails with "Connection closed by peer".
    This only shows up now and then, hence the many calls; a correct spawn passes every time.
    """
    for call in range(80):
        assert spawn(lambda rank, world_size: rank, 2) == [0, 1], f"call {call}"


def test_called_from_a_thread_pool_worker():
    """1: spawn works when the caller is a thread-pool worker (run_in_executor, a web server, ...).

    (CPython 3.11/3.12: a process forked from a ThreadPoolExecutor worker inherits the pool's
    exit hook, which tries to join the current thread, so the rank exits with code 1 after fn
    returned normally. The rank's report says "ok"; that is what counts.)
    """
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(spawn, lambda rank, world_size: rank * 2, 2).result(timeout=60) == [0, 2]


# ---------------------------------------------------------------- 2. what fn may be

def test_lambda_closure_args_and_kwargs():
    """2: fn may be a lambda or a closure over a local; *args and **kwargs pass through."""
    assert spawn(lambda rank, world_size, a, b=0: (rank, world_size, a, b), 2, "x", b=7) == [
        (0, 2, "x", 7), (1, 2, "x", 7)]

    offset = {"value": 100}  # a local the closure captures

    def closure(rank, world_size, *, scale):
        return offset["value"] + rank * scale

    assert spawn(closure, 3, scale=10) == [100, 110, 120]


def test_tensor_arguments_and_results():
    """2: arguments and return values may be tensors; values and dtypes survive."""
    x = torch.arange(4, dtype=torch.float64) / 3  # not exactly representable in float32

    def fn(rank, world_size, x, *, k):
        y = x * (rank + 1)
        dist.all_reduce(y)
        return y, k + rank

    results = spawn(fn, 2, x, k=torch.tensor([5, 6], dtype=torch.int64))
    for rank, (y, k) in enumerate(results):
        assert y.dtype == torch.float64 and k.dtype == torch.int64
        torch.testing.assert_close(y, x * 3, rtol=0, atol=0)
        assert k.tolist() == [5 + rank, 6 + rank]


CALLER_SCRIPT = """
    import multiprocessing.forkserver, os, sys, time
    import torch.distributed as dist
    import torch.distributed.optim  # one of utils.launch.LAZY_IMPORTS; torch._dynamo is another, not imported
    from utils.launch import LAZY_IMPORTS, spawn

    GREETING = "hello"   # a global of __main__ that fn uses

    def fn(rank, world_size):
        return f"{GREETING} {rank}/{dist.get_world_size()} {os.getpid() != PARENT}"

    def lazy_modules(rank, world_size):
        return sorted(name for name in LAZY_IMPORTS if name in sys.modules)

    PARENT = os.getpid()
    print("LAZY", spawn(lazy_modules, 2, start_method="spawn", warm=True)[0], flush=True)
    for method in ("spawn", "fork"):
        print("RESULT", method, spawn(fn, 2, start_method=method), flush=True)
    print("SERVER", multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
    time.sleep(600)  # until the tests kill it
"""


@pytest.fixture(scope="module")
def caller():
    """A Python that calls spawn as a notebook's kernel does, then keeps its warm server: shared by the tests of such
    a caller (each Python started imports torch, and its warm server too). (The process, {tag: what it printed}.)"""
    proc = subprocess.Popen(_python(CALLER_SCRIPT), cwd=REPO, env=_subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        printed = {}
        while "SERVER" not in printed:
            line = proc.stdout.readline()
            if not line:
                proc.kill()
                pytest.fail(f"the caller failed: {printed}\n{proc.communicate()[1]}")
            tag, _, text = line.strip().partition(" ")
            printed[tag if tag != "RESULT" else text.split()[0]] = text
        yield proc, printed
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.one_start_method
def test_fn_defined_in_main_module(caller):
    """2: fn defined at the top level of __main__ (the notebook case), with spawn and with fork."""
    _, printed = caller
    for method in ("spawn", "fork"):
        assert printed[method] == f"{method} ['hello 0/2 True', 'hello 1/2 True']", printed


# ---------------------------------------------------------------- 3. output

def _chatty(rank, world_size):
    time.sleep((world_size - rank) * 0.05)  # rank 2 prints first, rank 0 last
    print(f"out {rank}")
    print(f"multi {rank} a\nmulti {rank} b")
    print(f"err {rank}", file=sys.stderr)
    os.write(1, f"c-level out {rank}\n".encode())
    os.write(2, f"c-level err {rank}\n".encode())
    return rank


def test_output_is_captured_prefixed_and_in_rank_order(capfd):
    """3: stdout/stderr (Python and C level) come back prefixed, one prefix per line, rank 0 first."""
    assert spawn(_chatty, 3) == [0, 1, 2]
    out, err = capfd.readouterr()
    out_lines = [line for line in out.splitlines() if line.strip()]
    err_lines = [line for line in err.splitlines() if line.strip()]
    for rank in range(3):
        assert _prefixed(out, rank) == [f"out {rank}", f"multi {rank} a", f"multi {rank} b",
                                        f"c-level out {rank}"]
        assert _prefixed(err, rank) == [f"err {rank}", f"c-level err {rank}"]
    assert all(line.startswith("[rank ") for line in out_lines), out  # nothing leaked unprefixed
    assert all(line.startswith("[rank ") for line in err_lines), err
    ranks_in_order = [int(line.split("]")[0].split()[1]) for line in out_lines]
    assert ranks_in_order == sorted(ranks_in_order)  # all of rank 0's lines, then rank 1's, ...
    ranks_in_order = [int(line.split("]")[0].split()[1]) for line in err_lines]
    assert ranks_in_order == sorted(ranks_in_order)


# ---------------------------------------------------------------- 4. start method

@pytest.mark.one_start_method
def test_resolve_start_method(monkeypatch):
    """4: fork on Linux by default; $SPAWN_START_METHOD and then the argument override; bad -> ValueError."""
    monkeypatch.delenv("SPAWN_START_METHOD", raising=False)
    assert resolve_start_method() == "fork"
    assert resolve_start_method("spawn") == "spawn"
    monkeypatch.setenv("SPAWN_START_METHOD", "spawn")
    assert resolve_start_method() == "spawn"
    assert resolve_start_method("fork") == "fork"
    with pytest.raises(ValueError):
        resolve_start_method("bogus")
    monkeypatch.setenv("SPAWN_START_METHOD", "bogus")
    with pytest.raises(ValueError):
        resolve_start_method()
    with pytest.raises(ValueError):
        spawn(lambda rank, world_size: rank, 2)


def _probe_fn():
    """A closure (shipped by value even under spawn) that says whether the caller's state is there."""
    def probe(rank, world_size):
        import utils
        return hasattr(utils, "_probe")
    return probe


@pytest.mark.one_start_method
def test_start_method_fork_vs_spawn_end_to_end(monkeypatch):
    """4: start_method="spawn" and $SPAWN_START_METHOD=spawn really spawn; fork inherits the caller (with
    one thread per rank: as many ranks as cores)."""
    monkeypatch.delenv("SPAWN_START_METHOD", raising=False)
    monkeypatch.setattr(utils, "_probe", 1, raising=False)
    probe, n = _probe_fn(), max(2, CORES)
    assert spawn(probe, n) == [True] * n  # default: fork, the children inherit utils._probe
    assert spawn(probe, n, start_method="fork") == [True] * n
    assert spawn(probe, n, start_method="spawn") == [False] * n
    monkeypatch.setenv("SPAWN_START_METHOD", "spawn")
    assert spawn(probe, n) == [False] * n
    assert spawn(probe, n, start_method="fork") == [True] * n  # the argument beats the variable


def _parallel_matmul(rank, world_size):
    b = torch.randn(512, 512)
    return (b @ b).shape[0], torch.get_num_threads()


@pytest.mark.one_start_method
def test_a_rank_with_several_threads_works_after_the_caller_used_its_thread_pool():
    """9: GNU OpenMP's thread pool does not survive fork: a single rank (two threads on two cores) forked
    from a caller that had run a parallel matmul used to hang in its own first one."""
    a = torch.randn(512, 512)
    (a @ a).sum()
    assert spawn(_parallel_matmul, 1, timeout=30) == [(512, threads_per_rank(1))]


def _parallel_ops_and_parent(rank, world_size):
    b = torch.randn(512, 512)
    return (b @ b).shape[0], round(b.exp().sum().item() / b.exp().sum().item()), torch.get_num_threads(), os.getppid()


def test_apart_forks_its_one_thread_rank_after_the_caller_used_its_thread_pool(start_method):
    """9: apart's rank has one thread, so it is forked from the caller (no warm server to start: 3 s in a notebook
    whose first launch is a check's), and a rank of one thread never enters OpenMP: its matmul and its elementwise
    op (parallel with more threads) do not hang after the caller used its pool. With spawn: from the warm server."""
    a = torch.randn(512, 512)
    (a @ a).exp().sum()
    shape, one, threads, parent = utils.launch.apart(_parallel_ops_and_parent, timeout=30)
    assert (shape, one, threads) == (512, 1, 1)
    if start_method == "fork":
        assert parent == os.getpid()


@pytest.mark.one_start_method
def test_every_accepted_start_method_works():
    """4: a start method that resolve_start_method accepts ("forkserver" on Linux) works or is refused.

    Refusing it up front with ValueError is fine; accepting it and then failing every call is not.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    try:
        resolve_start_method("forkserver")
    except ValueError:
        return
    assert spawn(lambda rank, world_size: (rank, dist.get_world_size()), 2,
                 start_method="forkserver", timeout=60) == [(0, 2), (1, 2)]


# ---------------------------------------------------------------- 5. a rank that raises or dies

def fail_on_rank_two(rank, world_size, folder):
    _write_pid(folder, rank)
    print(f"rank {rank} before the failure")
    if rank == 2:
        time.sleep(0.3)  # the others are waiting in the barrier by now
        raise ValueError("boom from rank two")
    dist.barrier()


def test_rank_that_raises(tmp_path, capfd):
    """5, 3, 7: RankError within seconds naming the rank, the root cause and fn; output kept; no leftovers."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(fail_on_rank_two, 4, tmp_path, timeout=60)
    assert time.monotonic() - start < 10
    e = info.value
    message = str(e)
    assert isinstance(e, RuntimeError)
    assert e.rank == 2
    assert "rank 2 of 4" in message
    assert "ValueError" in message and "boom from rank two" in message
    assert "Traceback" in message and "fail_on_rank_two" in message
    # the root cause, not the gloo errors the other ranks got when rank 2 went away
    assert "ValueError" in e.summary and "Connection closed" not in e.summary
    out, _ = capfd.readouterr()
    for rank in range(4):
        assert f"rank {rank} before the failure" in _prefixed(out, rank)
    pids = _read_pids(tmp_path, 4, wait=0)
    assert _still_alive(pids) == []


def _exit_hard(how):
    def fn(rank, world_size):
        if rank == 1:
            time.sleep(0.2)
            if how == "exit3":
                os._exit(3)
            elif how == "exit0":
                os._exit(0)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    return fn


@pytest.mark.parametrize("how, expected", [("exit3", r"\b3\b"), ("sigkill", "SIGKILL"),
                                           ("exit0", r"\b0\b")])
def test_rank_that_dies_hard(how, expected):
    """5: a rank that dies without raising (os._exit(3), os._exit(0), SIGKILL) -> RankError naming it."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_exit_hard(how), 2, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1 of 2" in message
    assert re.search(expected, message.split("\n")[0]), message


def _dies_slowly_after_its_peer_reports(rank, world_size):
    if rank == 1:  # gloo's words for a pair whose other end has exited, said at once
        raise RuntimeError("[/gloo/transport/tcp/pair.cc:598] Connection reset by peer")
    print("terminate called after throwing an instance of 'gloo::EnforceNotMet'", file=sys.stderr, flush=True)
    time.sleep(1.0)  # rank 0 is still dying, as gloo's abort and faulthandler's dump take time under load
    os.kill(os.getpid(), signal.SIGABRT)


def test_a_rank_still_dying_is_named_not_the_peer_that_lost_its_connection():
    """The cause, not its echo: rank 1 reports a connection reset before rank 0, which caused it, has finished
    dying; the launcher waits for rank 0 to end on its own rather than killing it and naming rank 1."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_dies_slowly_after_its_peer_reports, 2, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 0 and "SIGABRT" in str(info.value).split("\n")[0], str(info.value)


def test_unpicklable_return_value():
    """5: a return value that cannot be pickled (a lock) -> RankError naming the rank, not a hang."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(lambda rank, world_size: threading.Lock() if rank == 1 else rank, 2, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    assert "rank 1 of 2" in str(info.value)
    assert "lock" in str(info.value).lower()


# ---------------------------------------------------------------- 6. a rank that stalls

def stall_on_rank_zero(rank, world_size, folder):
    _write_pid(folder, rank)
    print(f"rank {rank} before the stall")
    if rank == 0:
        time.sleep(60)
    dist.barrier()


def test_rank_that_stalls(tmp_path, capfd):
    """6, 3, 7: TimeoutError after `timeout` naming the unfinished ranks and where they were."""
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        spawn(stall_on_rank_zero, 3, tmp_path, timeout=1)  # the shortest: the test waits it out
    elapsed = time.monotonic() - start
    assert 0.75 < elapsed < 1 + 5
    message = str(info.value)
    assert "did not finish" in message
    where = _stall_lines(message)
    assert sorted(where) == [0, 1, 2], message
    assert "time.sleep" in where[0], message
    assert "barrier" in where[1] and "barrier" in where[2], message
    out, _ = capfd.readouterr()
    for rank in range(3):
        assert f"rank {rank} before the stall" in _prefixed(out, rank)
    assert _still_alive(_read_pids(tmp_path, 3, wait=0)) == []


def skip_the_barrier_on_rank_one(rank, world_size, folder):
    _write_pid(folder, rank)
    if rank != 1:
        dist.barrier()
    return rank


def test_rank_that_skips_a_collective(tmp_path):
    """6, 7: rank 1 returns without the barrier the others wait in -> an error, not a hang."""
    start = time.monotonic()
    with pytest.raises((RankError, TimeoutError)):
        spawn(skip_the_barrier_on_rank_one, 3, tmp_path, timeout=1)
    assert time.monotonic() - start < 1 + 5
    assert _still_alive(_read_pids(tmp_path, 3, wait=0)) == []


def one_more_all_reduce_on_rank_one(rank, world_size):
    for _ in range(1 + (rank == 1)):  # a parameter with a gradient on rank 1 only
        dist.all_reduce(torch.ones(3))


def test_ranks_that_make_different_collective_calls_get_an_error_that_says_so():
    """Rank 1 all-reduces once more than the others, which return: gloo says 'Connection reset by peer'; the
    error says that the ranks made different calls, and the usual causes."""
    message = ("rank 1 of 3 failed: it was in a collective when ranks? [02, ]+ had already returned from fn "
               ".*Connection (reset|closed) by peer.*different collective calls.*a parameter with a gradient on "
               "some ranks only")
    with pytest.raises(RankError, match=message) as info:
        spawn(one_more_all_reduce_on_rank_one, 3, timeout=20)
    assert "Traceback from rank 1" in str(info.value)  # gloo's own words are in the traceback


# ---------------------------------------------------------------- 7. no process outlives a call

def test_no_process_left_after_success():
    """7: after a successful call every rank's process is gone (joined, not a zombie)."""
    pids = spawn(lambda rank, world_size: os.getpid(), 3)
    assert _still_alive(pids) == []


def test_interrupt_while_starting_ranks(monkeypatch):
    """7: Ctrl-C while the ranks are being started: KeyboardInterrupt propagates, started ranks stop."""
    real_start = multiprocessing.process.BaseProcess.start
    started = []

    def start(self):
        if len(started) == 1:
            raise KeyboardInterrupt
        real_start(self)
        started.append(self.pid)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    with pytest.raises(KeyboardInterrupt):
        spawn(lambda rank, world_size: rank, 3, timeout=30)
    monkeypatch.undo()
    assert len(started) == 1
    assert _still_alive(started) == []


INTERRUPT_THEN_KILL_SCRIPT = """
    import os, pathlib, signal, sys, time
    from utils.launch import spawn

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    interrupted, killed = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

    def sleeper(rank, world_size, folder):
        tmp = folder / f"{rank}.tmp"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, folder / f"{rank}.pid")
        time.sleep(60)

    try:
        spawn(sleeper, 2, interrupted, timeout=120)
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        alive = []
        for rank in range(2):
            pid = int((interrupted / f"{rank}.pid").read_text())
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        print("INTERRUPTED, ranks still alive:", alive, flush=True)
    print("SECOND", spawn(lambda rank, world_size: rank * 10, 2), flush=True)
    spawn(sleeper, 2, killed, timeout=120)  # the test SIGKILLs this process during this call
    print("NOT KILLED", flush=True)
"""


def test_ranks_stop_on_ctrl_c_and_when_the_caller_is_killed(tmp_path):
    """7: SIGINT to the caller stops its ranks, and the caller can call spawn again afterwards; if the caller is
    then SIGKILLed, the ranks of its next call notice and exit within a few seconds. (One caller for both: each
    Python started imports torch, and with spawn starts its warm server.)"""
    interrupted, killed = tmp_path / "interrupted", tmp_path / "killed"
    interrupted.mkdir()
    killed.mkdir()
    proc = subprocess.Popen(_python(INTERRUPT_THEN_KILL_SCRIPT, interrupted, killed), cwd=REPO,
                            env=_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _read_pids(interrupted, 2, wait=60)
        proc.send_signal(signal.SIGINT)
        orphans = _read_pids(killed, 2, wait=60)
        assert _still_alive(orphans, grace=0) == orphans  # they really were sleeping
        assert proc.poll() is None  # the caller went on after the interrupt, into its third call
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=60)
    assert "INTERRUPTED, ranks still alive: []" in out, f"{out}\n{err}"
    assert "SECOND [0, 10]" in out, f"{out}\n{err}"
    assert "NOT KILLED" not in out, f"{out}\n{err}"
    assert _still_alive(pids, allow_zombie=True) == []
    # orphans are reaped by init, which is not ours to wait for: a zombie counts as gone
    assert _still_alive(orphans, grace=5.0, allow_zombie=True) == []


# ---------------------------------------------------------------- 8. ports and interfaces

def _busy_rank(rank, world_size, rendezvous, everyone):
    """Wait until the ranks of both calls are up, then all_reduce a few times; report listeners."""
    (Path(rendezvous) / f"{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(rendezvous)) < everyone:
        if time.monotonic() > deadline:
            raise RuntimeError("the other spawn call never started")
        time.sleep(0.02)
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    return t[0].item(), _listening_addresses()


@pytest.mark.one_start_method
def test_listening_socket_helper_sees_wildcard_binds():
    """8: the /proc/net parser used below finds a socket listening on all interfaces (self-check)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "127.0.0.1"),
                         (socket.AF_INET6, "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            s.listen()
            port = s.getsockname()[1]
            assert (host, port) in _listening_addresses()
    assert _decode_proc_net_address("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("::ffff:127.0.0.1")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("::") and not _is_loopback("192.0.2.2")


def test_concurrent_calls_do_not_collide_and_listen_on_loopback_only(tmp_path):
    """8: two spawn calls at once both succeed; every listening socket of every rank is on loopback."""
    sizes = (2, 3)
    results, errors = {}, []

    def call(n):
        try:
            results[n] = spawn(_busy_rank, n, tmp_path, sum(sizes), timeout=60)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a spawn call hung"
    if errors:
        raise errors[0]
    results = [results[n] for n in sizes]
    assert len(os.listdir(tmp_path)) == sum(sizes)  # really 5 distinct ranks, all up at once
    for n, result in zip(sizes, results, strict=True):
        assert [value for value, _ in result] == [float(n ** 5)] * n
        for _, listening in result:
            for address, port in listening:
                assert _is_loopback(address), f"a rank listens on {address}:{port}"
    assert any(listening for result in results for _, listening in result)  # gloo does listen


# ---------------------------------------------------------------- 9. threads

@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_threads_per_rank(world_size):
    """9: each rank gets max(1, cores // world_size) intra-op threads."""
    expected = max(1, CORES // world_size)
    assert spawn(lambda rank, ws: torch.get_num_threads(), world_size) == [expected] * world_size


# ---------------------------------------------------------------- 10. bad arguments

class _Started(Exception):
    """Raised by the patched process machinery: a process was about to start."""


@pytest.fixture
def no_process_may_start(monkeypatch):
    def refuse(*args, **kwargs):
        raise _Started("spawn tried to start a process")

    monkeypatch.setattr(utils.launch.mp, "get_context", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def _ok(rank, world_size):
    return rank


@pytest.mark.one_start_method
@pytest.mark.parametrize("kwargs, error", [
    (dict(fn=42), TypeError),
    (dict(fn="fn"), TypeError),
    (dict(world_size="2"), TypeError),
    (dict(world_size=2.0), TypeError),
    (dict(world_size=True), TypeError),
    (dict(world_size=None), TypeError),
    (dict(world_size=0), ValueError),
    (dict(world_size=-1), ValueError),
    (dict(backend="nccl"), ValueError),
    (dict(backend="mpi"), ValueError),
    (dict(backend="bogus"), ValueError),
    (dict(timeout=0), ValueError),
    (dict(timeout=-1), ValueError),
    (dict(timeout="10"), TypeError),
    (dict(start_method="bogus"), ValueError),
], ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__)
def test_bad_arguments_fail_before_any_process_starts(no_process_may_start, kwargs, error):
    """10: each bad argument raises TypeError/ValueError before any process starts."""
    if kwargs.get("backend") == "nccl" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: nccl is a valid backend here")
    call = dict(fn=_ok, world_size=2) | kwargs
    fn, world_size = call.pop("fn"), call.pop("world_size")
    with pytest.raises(error):
        spawn(fn, world_size, **call)


@pytest.mark.one_start_method
def test_good_arguments_reach_process_start(no_process_may_start):
    """10: (self-check) the patch above does catch a call that starts processes."""
    with pytest.raises(_Started):
        spawn(_ok, 2)


# ---------------------------------------------------------------- 11. torchrun

@pytest.mark.slow  # 10 s; every notebook's torchrun runs (pytest -m slow) go through this path too
@pytest.mark.one_start_method
def test_under_torchrun(tmp_path):
    """11: under torchrun, fn runs in the torchrun ranks themselves; world_size must match."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "tests/torchrun_spawn.py"],  # TMPDIR: torchrun's log folder (torchelastic_*) goes where pytest cleans up
        cwd=REPO, env={**_subprocess_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(2):
        for call in (1, 2):
            assert f"rank {rank} ok (call {call})" in proc.stdout, output
        assert f"rank {rank} ok (world_size mismatch refused)" in proc.stdout, output
    # fn's prints come back once per rank, prefixed, as in a notebook
    assert proc.stdout.count("[rank 0] fn ran on rank 0") == 2, output
    assert proc.stdout.count("[rank 1] fn ran on rank 1") == 2, output


RANK_ONE_RAISES = """
import os
import torch
import torch.distributed as dist
from utils.launch import spawn

def fn(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(3))  # waits for rank 1, which never comes

spawn(fn, int(os.environ["WORLD_SIZE"]), timeout=150)  # above the 120 s the test waits
"""


@pytest.mark.slow
@pytest.mark.one_start_method
def test_under_torchrun_a_rank_that_raises_does_not_wait_for_the_others_at_exit(tmp_path):
    """11: the rank that raised exits at once (no barrier at exit: the others may be waiting for it in a collective),
    so the one left waiting gets 'Connection closed by peer' and torchrun names rank 1, long before the group's
    timeout (150 s here; before, the failed rank's exit barrier met rank 0's all-reduce and both waited for it)."""
    script = tmp_path / "rank_one_raises.py"
    script.write_text(RANK_ONE_RAISES)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=REPO, env={**_subprocess_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "boom on rank 1" in output, output
    assert re.search(r"Root Cause \(first observed failure\):\s+\[0\]:[^\n]*\n\s+time[^\n]*\n\s+host[^\n]*\n"
                     r"\s+rank\s+: 1", output), output


# ---------------------------------------------------------------- 12. warm ranks (the spawn start method)

def _set_everything(rank, world_size):
    """Runs in a rank: change every kind of process state a later call could trip over."""
    utils._left_behind = True
    dist.all_reduce = lambda *args, **kwargs: None  # a patched torch.distributed function
    torch.manual_seed(1234)
    torch.set_num_threads(7)
    os.environ["SPAWN_LEAK_PROBE"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")


def _look_at_everything(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return dict(left_behind=hasattr(utils, "_left_behind"), all_reduce=t.item(), seed=torch.initial_seed(),
                threads=torch.get_num_threads(), env="SPAWN_LEAK_PROBE" in os.environ,
                dtype=torch.get_default_dtype(), device=str(torch.empty(0).device),
                group=(dist.get_rank(), dist.get_world_size()))


def test_nothing_leaks_from_one_call_into_the_next():
    """12: module state, a patched dist function, RNG, threads, environment, default dtype: each call starts clean."""
    spawn(_set_everything, 2)
    for world_size in (2, 3):
        seen = spawn(_look_at_everything, world_size)
        for rank, s in enumerate(seen):
            assert s == dict(left_behind=False, all_reduce=float(world_size), seed=s["seed"],
                             threads=max(1, CORES // world_size), env=False, dtype=torch.float32, device="cpu",
                             group=(rank, world_size)), s
            assert s["seed"] != 1234


def test_an_edited_library_file_is_seen_by_the_next_call():
    """12: an instructor editing a file under utils/ between two calls gets the new code, not a warm copy."""
    probe = REPO / "utils" / "_edited_probe.py"

    def value(rank, world_size):
        from utils import _edited_probe
        return _edited_probe.VALUE

    try:
        probe.write_text("VALUE = 1\n")
        assert spawn(value, 2) == [1, 1]
        probe.write_text("VALUE = 2\n")
        assert spawn(value, 2) == [2, 2]
    finally:
        probe.unlink(missing_ok=True)


def _forkserver_pid():
    import multiprocessing.forkserver
    return multiprocessing.forkserver._forkserver._forkserver_pid


def test_a_failed_or_stalled_call_leaves_warm_ranks_working(start_method):
    """12: after a rank raised and after a stall, the next call works, from the same warm server."""
    spawn(_ok, 2)
    server = _forkserver_pid()
    with pytest.raises(RankError):
        spawn(lambda rank, world_size: 1 / 0, 2)
    with pytest.raises(TimeoutError):
        spawn(lambda rank, world_size: time.sleep(30), 2, timeout=1)
    assert spawn(_ok, 2) == [0, 1]
    if start_method == "spawn":
        assert _forkserver_pid() == server is not None  # no new cold start


def _parent_pid(rank, world_size):
    return os.getppid()


@pytest.mark.slow  # 7 s of cold starts (each rank imports torch afresh): the default run starts warm ranks
@pytest.mark.one_start_method
def test_warm_ranks_can_be_turned_off(monkeypatch):
    """12: warm=False or SPAWN_WARM=0 spawns every rank from the caller; warm ranks are the server's children."""
    monkeypatch.delenv("SPAWN_WARM", raising=False)
    me = os.getpid()  # one rank per call: a rank spawned afresh imports torch (seconds); one shows whose child it is
    assert spawn(_parent_pid, 1, start_method="spawn", warm=False) == [me]
    assert spawn(_parent_pid, 1, start_method="spawn") != [me]
    monkeypatch.setenv("SPAWN_WARM", "0")
    assert spawn(_parent_pid, 1, start_method="spawn") == [me]
    assert spawn(_parent_pid, 1, start_method="spawn", warm=True) != [me]  # the argument beats the variable
    with pytest.raises(TypeError):
        spawn(_ok, 2, warm="yes")


@pytest.mark.one_start_method
def test_warm_ranks_start_with_the_slow_modules_the_caller_imported(caller):
    """12: the warm server imports, of torch's slow lazily loaded modules, those its caller has (as a forked rank
    inherits them): what the ranks use is not imported again in every call, what they do not is not paid for."""
    _, printed = caller
    assert printed["LAZY"] == "['torch.distributed.optim']", printed


@pytest.mark.one_start_method
@pytest.mark.parametrize("warm", [True, False])
def test_ranks_leave_without_pythons_teardown(warm, capfd):
    """12: a rank exits right after its report. A rank spawned afresh (warm=False) used to run Python's teardown,
    which destroys gloo's group with its threads still running and aborts the process ("terminate called without
    an active exception", a crash dump in the call's output) after a successful call; atexit shows it ran."""
    def all_reduce_then_register_teardown(rank, world_size):
        import atexit
        dist.all_reduce(torch.ones(1))
        atexit.register(print, "python's teardown ran")

    assert spawn(all_reduce_then_register_teardown, 2, start_method="spawn", warm=warm) == [None, None]
    out, err = capfd.readouterr()
    assert "teardown ran" not in out + err and "Fatal Python error" not in err, out + err


def _tcp_listeners(pid):
    """The TCP sockets process `pid` holds in state LISTEN."""
    inodes = {m[1] for fd in os.listdir(f"/proc/{pid}/fd")
              if (m := re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}")))}
    rows = [row.split() for table in ("/proc/net/tcp", "/proc/net/tcp6") for row in
            Path(table).read_text().splitlines()[1:]]
    return [row[1] for row in rows if row[3] == "0A" and row[9] in inodes]


@pytest.mark.one_start_method
def test_the_warm_server_listens_on_no_port_and_dies_with_its_owner(caller):
    """12: between calls the warm server holds no TCP listener; SIGKILL its owner and it is gone in seconds."""
    owner, printed = caller
    server = int(printed["SERVER"])
    try:
        assert _exists(server) and _tcp_listeners(server) == []
    finally:
        owner.kill()
        owner.wait()
    assert _still_alive([server], grace=5.0, allow_zombie=True) == []
