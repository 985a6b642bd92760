"""A class that cheats (issue 44): each tamper gets no credit for the exercise it tampers with and changes no other
student's rows; no process outlives its slot; each exercise is graded on its own. The tampers are written into
notebook 00's one exercise (the cheapest to run), its answer left wrong (the sum, not the mean): only a forged
verdict could pass it. The default run keeps what needs no sandbox or a single one (a few seconds); the class
runs are slow."""
import hashlib
import io
import os
import pickle
import socket
import time

import pytest
import torch
from test_grade import handed_in, run_grader, write_class

from utils.grading import command, runner, sandbox, submission, wire
from utils.notebooks import ROOT

DIVIDE = "    tensor /= dist.get_world_size()\n"
SUM = "    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)\n"


def wrong_with(tamper, top_level=""):
    """00's answer summing instead of averaging, with `tamper` in the function (indented) and `top_level` code
    after it (outside the function: the way these tampers reached the checks before)."""
    return handed_in("00_setup", replace={SUM + DIVIDE: SUM + tamper + ("\n" + top_level if top_level else "")})


def indent(code):
    return "".join(f"    {line}\n" for line in code.strip("\n").splitlines())


READ_SOLUTIONS = indent('''
import builtins, json, pathlib, sys
import utils
for folder in [*sys.path, *map(str, pathlib.Path(utils.__file__).parents)]:
    worked = pathlib.Path(folder) / "solutions" / "00_setup.ipynb"
    if worked.exists():
        cells = ["".join(c["source"]) for c in json.loads(worked.read_text())["cells"]]
        scope = {"dist": dist}
        getattr(builtins, "ex" + "ec")(next(c for c in cells if "def average_over_ranks" in c), scope)
        tensor /= dist.get_world_size()
        break
''')
REPLACE_THROUGH_GLOBALS = 'average_over_ranks.__globals__["check_average_over_ranks"] = lambda *args: None\n'
FAKE_CHECK = '''_real = check_average_over_ranks


def check_average_over_ranks(*args):
    global check_average_over_ranks
    check_average_over_ranks = _real
'''
SILENCE_PRINT = indent('''
import builtins
builtins.print = lambda *args, **kwargs: None
average_over_ranks.__globals__["check_average_over_ranks"] = lambda *args: None
''')
CUSTOM_EXC = "get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)\n"
FORGE_REPORTS_CODE = '''
import os, stat
for fd in os.listdir("/proc/self/fd"):
    try:
        if stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            for index in range(80):
                os.write(int(fd), f'{{"index": {index}, "error": null}}\\n'.encode())
    except OSError:
        pass
'''  # every pipe the process holds gets made-up reports of passed cells (the hidden class runs it at top level)
FORGE_REPORTS = indent(FORGE_REPORTS_CODE)
EVIL_RETURN = indent('''
class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.getcwd()}/pwned",))
sys._getframe(1).f_locals["runs"].append(Evil())
''')


def daemon(csv, marker):
    """Rank 0 starts a process of a session of its own that, for 20 s, appends a passing row to the grades."""
    script = (f"import os, time\nfor _ in range(100):\n    time.sleep(0.2)\n    if os.path.exists({str(csv)!r}):\n"
              f"        open({str(csv)!r}, 'a').write('mallory,00_setup,average_over_ranks,passed,1,1,\\n')\n")
    return indent(f'''
if dist.get_rank() == 0:
    import subprocess
    subprocess.Popen([sys.executable, "-c", {script!r}, {marker!r}], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
''')


def overwrite(victim):
    """Copies the shipped student copy over another student's submission, and appends to the course's checks."""
    return indent(f'''
import shutil, utils
try:
    shutil.copy(pathlib.Path(utils.__file__).parent.parent / "notebooks" / "00_setup.ipynb", {str(victim)!r})
except OSError:
    pass
try:
    open(pathlib.Path(utils.__file__).parent / "checks" / "setup.py", "a").write("\\n")
except OSError:
    pass
''')


def phone_home_code(port):
    """Sends a message to a listener of the test's on this machine's loopback (the sandbox shares none)."""
    return f'''
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"pwned")
except OSError:
    pass
'''


def phone_home(port):
    return indent(phone_home_code(port))


def test_an_answer_may_only_define_its_functions():
    """Each tamper that ran at a cell's top level (the way they reached the checks before) is refused unread; the
    same code inside the function is accepted (it runs in the ranks); comments and blank lines are fine."""
    a = submission.assignments()["00_setup"]
    cell = a.solution.cells[a.exercises[0].cell].source
    inside = cell.replace(DIVIDE, DIVIDE + "    # a comment\n\n    print = None\n")
    assert submission.answer_outside_functions(inside, cell) is None
    for top_level in (REPLACE_THROUGH_GLOBALS, FAKE_CHECK, "print = lambda *args, **kwargs: None\n", CUSTOM_EXC,
                      "average_over_ranks = print\n", "import builtins\n"):
        graded = cell.replace(DIVIDE, DIVIDE + "\n" + top_level)
        assert "code outside average_over_ranks" in submission.answer_outside_functions(graded, cell), top_level
    moved = cell.replace("def average_over_ranks(tensor):", "def average_over_ranks(tensor, n=print('hi')):")
    assert submission.answer_outside_functions(moved, cell)  # a default value runs when the function is defined
    sync = submission.assignments()["10_expert_parallel"].exercises[0]
    source = submission.assignments()["10_expert_parallel"].solution.cells[sync.cell].source
    assert submission.functions_with_answers(source) == (["AllToAll.forward", "AllToAll.backward"], True)


def test_what_a_rank_reports_is_read_as_data_only():
    """Tensors, parameters and the checks' dataclasses come back; a callable of the rank's choosing does not."""
    import cloudpickle

    from utils.checks.setup import AverageRun
    t = torch.arange(6.0).reshape(2, 3)
    data = {"runs": [AverageRun(t, t[:, 1], 1, 1, t)], "p": torch.nn.Parameter(t.clone()), "dtype": torch.bfloat16}
    back = runner.safe_load(io.BytesIO(cloudpickle.dumps(data)))
    assert torch.equal(back["runs"][0].after, t[:, 1]) and isinstance(back["p"], torch.nn.Parameter)

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))
    for evil in (Evil(), lambda: None, print, torch.load):
        with pytest.raises(pickle.UnpicklingError, match="does not load"):
            runner.safe_load(io.BytesIO(cloudpickle.dumps(evil)))


FORK_OF_A_FORK = """
import os
from utils.grading.runner import close_in_forks
read_end, write_end = os.pipe()
close_in_forks(read_end)
pid = os.fork()
if pid == 0:  # a fork (a demo's): read_end closed in it, its number reused, then a fork of the fork (a rank)
    a, b = os.pipe()
    grandchild = os.fork()
    if grandchild == 0:
        os._exit(0 if read_end in (a, b) and os.fstat(read_end) else 1)
    os._exit(os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1]))
os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_fork_of_a_fork_keeps_the_files_it_opened():
    """The checking process's pipes are closed in its forks; a fork of a fork (the ranks a demo run in a fork starts:
    06's last cells) keeps the files that reuse their numbers. Closed there again, 06's 4-rank cell lost a rank's
    socket or pipe ("Bad file descriptor", or gloo's SIGABRT) and the solution itself failed when graded."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", FORK_OF_A_FORK], env=env, timeout=60).returncode == 0


@pytest.mark.skipif(not sandbox.bwrap(), reason="bubblewrap is not installed")
def test_the_sandbox_shows_the_course_read_only_without_solutions(tmp_path):
    """One slot, no notebook: what the checking process sees (about 2 s: it imports torch)."""
    (tmp_path / "slot").mkdir()
    slot = sandbox.Slot(tmp_path / "slot", seconds=60, graded="00_setup")
    try:
        probe = '''
import os, pathlib, socket, utils
course = pathlib.Path(utils.__file__).parent.parent
assert not (course / "solutions" / "00_setup.ipynb").exists(), "the graded notebook's solution is visible"
assert (course / "solutions" / "05_fsdp.ipynb").exists() and not (course / "notebooks").exists()
assert not os.path.exists(%r), "the grader's folders are visible"
for path in (course / "utils" / "probe.py", "/etc/probe"):
    try:
        open(path, "w")
        raise AssertionError(f"{path} is writable")
    except OSError:
        pass
open("here.txt", "w").write("mine"); open("/tmp/mine.txt", "w").write("mine")
assert open("/proc/self/status").read().split("CapEff:")[1].split()[0] == "0000000000000000", "capabilities"
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    raise AssertionError("the network is reachable")
except OSError:
    pass
socket.create_server(("127.0.0.1", 0)).close()  # loopback is up
''' % str(tmp_path)
        assert slot.run(1, probe) is None
        reach_the_checker = '''
import ctypes, os
checker = os.getpid()
pid = os.fork()
if pid == 0:  # a rank: the checking process is not dumpable, and the sandbox leaves no capability to override it
    refused = ctypes.CDLL(None, use_errno=True).ptrace(16, checker, 0, 0) == -1  # PTRACE_ATTACH
    try:
        open(f"/proc/{checker}/mem", "r+b").close()
    except OSError:
        os._exit(0 if refused else 1)
    os._exit(2)
assert os.waitpid(pid, 0)[1] == 0, "a fork of the checking process reached its memory"
'''
        assert slot.run(3, reach_the_checker) is None
        assert slot.wire[3] == 0  # no message was sent: nothing on the wire
        assert slot.run(4, CHILD_ON_A_SOCKET_OF_ITS_OWN) is None
        assert slot.wire[4] >= 10, slot.wire  # a fork's socket of its own counts: the kernel counts, not the rank
        marker = f"grading-probe-{os.getpid()}"
        daemon = f"import subprocess; subprocess.Popen(['sh', '-c', 'sleep 30', {marker!r}], start_new_session=True)"
        assert slot.run(2, f"import os\nif os.fork() == 0:\n    {daemon}\n    os._exit(0)") is None
        time.sleep(0.5)
        assert [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]
    finally:
        slot.close()
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]
    assert (tmp_path / "slot" / "here.txt").read_text() == "mine"


CHILD_ON_A_SOCKET_OF_ITS_OWN = '''
import os, socket
server = socket.create_server(("127.0.0.1", 0))
pid = os.fork()
if pid == 0:  # a child of the cell's, on a connection of its own: 20 messages, each sent at once
    with socket.create_connection(server.getsockname()) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(20):
            s.sendall(b"x" * 100)
            s.recv(1)
    os._exit(0)
peer, _ = server.accept()
for _ in range(20):
    peer.recv(100)
    peer.sendall(b"k")
os.waitpid(pid, 0)
'''


def test_only_clearly_more_messages_than_the_reference_fail():
    assert wire.too_much(None, 900) is None and wire.too_much(2000, None) is None  # no sandbox: nothing compared
    assert wire.too_much(909, 909) is None and wire.too_much(1100, 909) is None  # honest variations
    assert "2127 TCP segments" in wire.too_much(2127, 909) and "reference's send 909" in wire.too_much(2127, 909)
    assert wire.added(wire.added(None, None), 5) == 5 and wire.added(3, None) == 3


def test_without_bubblewrap_the_grader_warns_what_is_not_isolated(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "bwrap", lambda: None)
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "00_setup.ipynb").write_text((ROOT / "notebooks" / "00_setup.ipynb").read_text())
    assert command.main([str(tmp_path), "--out", str(tmp_path / "grades.csv"), "--timeout", "60"]) == 0
    warning = capsys.readouterr().err
    assert "bubblewrap (bwrap) is not available" in warning and "read solutions/" in warning
    assert "where it can forge the count" in warning


def checks_digest():
    files = sorted((ROOT / "utils" / "checks").glob("*.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


@pytest.mark.slow  # a class of 13 runs of notebook 00: about a minute on 2 loaded cores
@pytest.mark.skipif(not sandbox.bwrap(), reason="bubblewrap is not installed")
def test_every_tamper_gets_no_credit_and_touches_no_other_row(tmp_path, monkeypatch):
    csv, marker = tmp_path / "grades.csv", f"grading-daemon-{os.getpid()}"
    victim = tmp_path / "submitted" / "victor" / "00_setup.ipynb"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    before = checks_digest()
    tampers = {
        "reads_solutions": wrong_with(READ_SOLUTIONS),
        "globals_in_function": wrong_with(indent(REPLACE_THROUGH_GLOBALS)),
        "globals_top_level": wrong_with("", REPLACE_THROUGH_GLOBALS),
        "fake_check": wrong_with("", FAKE_CHECK),
        "silenced_print": wrong_with(SILENCE_PRINT),
        "print_top_level": wrong_with("", "print = lambda *args, **kwargs: None\n" + REPLACE_THROUGH_GLOBALS),
        "custom_exc": wrong_with("", CUSTOM_EXC),
        "custom_exc_in_function": wrong_with(indent(CUSTOM_EXC)),
        "daemon": wrong_with(daemon(csv, marker)),
        "overwriter": wrong_with(overwrite(victim)),
        "forged_reports": wrong_with(FORGE_REPORTS),
        "evil_return": wrong_with(EVIL_RETURN),
        "phone_home": wrong_with(phone_home(listener.getsockname()[1])),
    }
    honest = handed_in("00_setup")
    write_class(tmp_path / "submitted", {**{name: ("00_setup.ipynb", text) for name, text in tampers.items()},
                                         "alice": ("00_setup.ipynb", honest), "victor": ("00_setup.ipynb", honest)})
    rows, _, left = run_grader(tmp_path, monkeypatch, "--timeout", "120")
    for name in tampers:
        (row,) = rows[name]
        assert row["verdict"] != "passed" and row["points"] == "0", (name, row)
    assert rows["alice"][0]["verdict"] == rows["victor"][0]["verdict"] == "passed"
    assert victim.read_text() == honest and checks_digest() == before
    assert "tampering: code outside average_over_ranks" in rows["globals_top_level"][0]["message"]
    assert "sum over ranks" in rows["reads_solutions"][0]["message"]  # it found no solution to run
    time.sleep(1)  # the daemon, were it alive, appends every 0.2 s
    assert "mallory" not in csv.read_text()
    assert not left and not [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]
    assert not list((tmp_path / "runs").rglob("pwned"))
    with pytest.raises(BlockingIOError):
        listener.accept()


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow  # notebooks 02 and 10, two submissions each: about two minutes on 2 loaded cores
def test_a_wrong_exercise_fails_only_itself(tmp_path, monkeypatch):
    """02: a wrong average fails that exercise only; 10: a wrong all-to-all only its own. The later exercises,
    whose checks call them, pass with the reference, and say so."""
    no_division = {"            dist.all_reduce(p.grad)\n            p.grad /= world_size\n":
                   "            dist.all_reduce(p.grad)\n"}
    no_exchange = {"        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n":
                   "        out.copy_(x[:len(out)]) if len(out) <= len(x) else None\n"}
    write_class(tmp_path / "submitted", {"dp": ("02_data_parallel.ipynb", handed_in("02_data_parallel", no_division)),
                                         "ep": ("10_expert_parallel.ipynb",
                                                handed_in("10_expert_parallel", no_exchange))})
    rows, _, left = run_grader(tmp_path, monkeypatch, "--timeout", "600")
    for student, wrong in (("dp", "broadcast_parameters, average_gradients"), ("ep", "AllToAll")):
        verdicts = {r["exercise"]: r for r in rows[student]}
        assert verdicts.pop(wrong)["verdict"] == "failed", rows[student]
        assert {r["verdict"] for r in verdicts.values()} == {"passed"}, rows[student]
        assert any(f"checked with the reference {wrong} (yours: failed)" in r["message"] for r in verdicts.values())
    assert not left


# ---------------------------------------------------------------- the checks that once ran the student's code here

# Inside the student's function: whatever a check in this process would read, patched to agree. The check runs the
# function in a rank of its own and compares here, so none of it reaches the comparison.
PATCH_THE_CHECK = '''
    import builtins, sys
    import torch as _torch
    for _module in [m for n, m in list(sys.modules.items()) if n.startswith("utils.checks")]:
        for _name in [n for n in vars(_module) if n.startswith(("check_", "_same", "close", "max_abs_diff"))]:
            setattr(_module, _name, (lambda *a, **k: True) if not _name.startswith("check_") else
                    (lambda *a, **k: None))
    _torch.equal = _torch.allclose = lambda *a, **k: True
    builtins.print = lambda *a, **k: None
'''


class LyingTensor(torch.Tensor):
    """A tensor every comparison finds equal to anything."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.equal, torch.allclose, torch.Tensor.__eq__):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.slow  # 1 s, and 5 to import 06's checks (torch._dynamo, torch.distributed.optim) on a loaded machine
def test_recompute_that_patches_its_check_gets_no_credit():
    """06: parameters' gradients dropped (wrong), the check, torch.equal and print patched from backward."""
    from utils.checks.mixed_precision import check_recompute
    from utils.notebooks import solution
    wrong = solution("06_mixed_precision", replace={
        "        return (None, *grads)\n": PATCH_THE_CHECK.replace("\n    ", "\n        ") +
        "        return (None, grads[0], *[torch.zeros_like(g) for g in grads[1:]])\n"})
    with pytest.raises(AssertionError, match="weight gradient differs"):
        check_recompute(wrong.recompute, 8, 3, 6)
    assert torch.equal is not None and not torch.equal(torch.zeros(1), torch.ones(1))


@pytest.mark.slow  # 1 s, and seconds more to import 09's checks on a loaded machine
def test_blockwise_attention_that_patches_its_check_or_lies_gets_no_credit():
    """09: plain zeros, with the check patched; then the right values' shapes in tensors whose __eq__ lies."""
    from utils.checks.context_parallel import check_blockwise_attention
    from utils.notebooks import solution
    patched = solution("09_context_parallel", replace={
        "    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)":
        PATCH_THE_CHECK + "    return torch.zeros_like(q), torch.zeros(q.shape[:-1], dtype=q.dtype)"})
    with pytest.raises(AssertionError, match="out differs from plain attention"):
        check_blockwise_attention(patched.blockwise_attention)

    def lying(q, k, v, block_size, mask="causal"):
        return torch.zeros_like(q).as_subclass(LyingTensor), torch.zeros(q.shape[:-1]).as_subclass(LyingTensor)
    with pytest.raises(AssertionError, match=r"must return \(out, lse\)"):
        check_blockwise_attention(lying)


def test_backward_split_that_patches_its_check_gets_no_credit():
    """11: B returns the gradient it was given (wrong), with the check's comparisons patched from B."""
    from utils.checks.pipeline import check_backward_split
    from utils.notebooks import solution
    wrong = solution("11_pipeline_schedules", replace={
        "    (dx,) = torch.autograd.grad(y, x, grad, retain_graph=True)\n    return dx\n":
        PATCH_THE_CHECK + "    return grad\n"})
    with pytest.raises(AssertionError, match="returned the gradient it was given"):
        check_backward_split(wrong.backward_input, wrong.backward_weight, 8, 4, 8, 2)


# ---------------------------------------------------------------- counts the student's code cannot forge

# 01's ring reduce-scatter done by an all-reduce, the rank's communication log forged to show a ring's isend: no
# collective in the log, a ring's bytes. Only the kernel's count of the segments sent tells.
RING_BODY = """    buffer = torch.empty_like(chunks[0])  # chunk 0 is the longest
    for step in range(world_size - 1):
        send_chunk = chunks[(rank - step - 1) % world_size]
        recv_chunk = chunks[(rank - step - 2) % world_size]
        incoming = buffer[: recv_chunk.numel()]
        exchange(send_chunk, right, incoming, left)
        recv_chunk += incoming
"""
FORGED_LOG = """    from utils.intercept import Call
    from utils.checks.collectives import ring_bytes_per_rank
    ring = ring_bytes_per_rank("reduce_scatter", tensor.numel(), tensor.element_size(), world_size)[rank]
"""
FORGED_RINGS = {
    "log_from_closure": FORGED_LOG + """\
    log = dict(zip(dist.isend.__code__.co_freevars, [c.cell_contents for c in dist.isend.__closure__]))["log"]
    dist.all_reduce.__wrapped__(tensor)
    log.append(Call("isend", ring, False, 0, 0))
""",
    "log_through_gc_group_direct": FORGED_LOG + """\
    import gc
    log = next(o for o in gc.get_referents(*dist.isend.__closure__) if type(o) is list and not o)
    dist.distributed_c10d._get_default_group().allreduce([tensor]).wait()
    log.append(Call("isend", ring, False, 0, 0))
""",
    "all_gather_and_a_sum": FORGED_LOG + """\
    log = dict(zip(dist.isend.__code__.co_freevars, [c.cell_contents for c in dist.isend.__closure__]))["log"]
    pieces = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather.__wrapped__(pieces, tensor)
    tensor.copy_(sum(pieces))
    log.append(Call("isend", ring, False, 0, 0))
""",
    "child_with_a_group_of_its_own": FORGED_LOG + """\
    import datetime, gc, os
    log = next(o for o in gc.get_referents(*dist.isend.__closure__) if type(o) is list and not o)
    counter = f"/tmp/forged-{world_size}-{rank}"
    calls = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(calls + 1))
    shared = tensor.clone().share_memory_()
    child = os.fork()
    if child == 0:  # a process group of its own, in a process the checks do not watch
        try:
            wait = datetime.timedelta(seconds=30)
            store = dist.TCPStore("127.0.0.1", 29500 + 100 * world_size + calls, world_size, rank == 0, wait)
            dist.ProcessGroupGloo(store, rank, world_size, wait).allreduce([shared]).wait()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    tensor.copy_(shared)
    log.append(Call("isend", ring, False, 0, 0))
""",
}


@pytest.mark.slow  # the solution of 01 once (the reference's count) and five submissions: about a minute
@pytest.mark.skipif(not sandbox.bwrap(), reason="bubblewrap is not installed")
def test_a_forged_communication_log_gets_no_credit(tmp_path, monkeypatch):
    """Each forge passes every check that reads the rank's log (its only failure is the kernel's count); the
    honest student passes everything, and the forgers' other exercises pass."""
    write_class(tmp_path / "submitted", {
        **{name: ("01_collectives.ipynb", handed_in("01_collectives", replace={RING_BODY: forge}))
           for name, forge in FORGED_RINGS.items()},
        "alice": ("01_collectives.ipynb", handed_in("01_collectives"))})
    rows, _, left = run_grader(tmp_path, monkeypatch, "--timeout", "300")
    assert {r["verdict"] for r in rows["alice"]} == {"passed"}, rows["alice"]
    for name in FORGED_RINGS:
        verdicts = {r["exercise"]: r for r in rows[name]}
        forged = verdicts.pop("ring_reduce_scatter")
        assert forged["verdict"] == "failed" and "TCP segments" in forged["message"], (name, forged)
        assert {r["verdict"] for r in verdicts.values()} == {"passed"}, (name, rows[name])
    assert not left
