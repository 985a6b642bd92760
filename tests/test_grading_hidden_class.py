"""A stand-in for the hidden class of issue 44, on notebooks 05 and 09: adversarial submissions (each tamper inside a
wrong answer, so that only a forged verdict could pass it) and honest ones with one wrong earlier exercise. Target:
no tampered exercise gets credit, no other row changes, nothing outlives its slot, and a wrong earlier exercise
fails only itself. Slow: a class of 23 runs of notebooks 05 and 09 (6 to 20 minutes on 2 shared cores)."""
import json
import os
import socket
import time

import pytest
from test_grade import handed_in, run_grader, write_class
from test_grading_tampers import FORGE_REPORTS_CODE as FORGE_REPORTS
from test_grading_tampers import _cmdline, checks_digest
from test_grading_tampers import phone_home_code as phone_home

from utils.grading import sandbox
from utils.notebooks import ROOT

# 05: Zero1AdamW's gradient summed over ranks, not averaged (its first exercise); the tamper runs in its step
ZERO1 = "            shard.grad = fsdp.shard(p.grad / self.world_size, self.rank, self.world_size)\n"
ZERO1_WRONG = "            shard.grad = fsdp.shard(p.grad, self.rank, self.world_size)\n"
# 09: merge adds the blocks' outputs instead of weighting them (its first exercise); the tamper runs in merge
MERGE = "    out = torch.exp(lse - shift)[..., None] * out + torch.exp(block_lse - shift)[..., None] * block_out\n"
MERGE_WRONG = "    out = out + block_out\n"
WRONG = {"05_fsdp": (ZERO1, ZERO1_WRONG, 12, "gather_parameters, Zero1AdamW"),
         "09_context_parallel": (MERGE, MERGE_WRONG, 4, "merge")}
# What a tamper that found the worked answer keeps (on a function of its own, where the text guard does not look),
# and how the answer then uses it: the right result, from the solution's own code. Every tamper here is written past
# the grader's text guard (submission.patches: names set on modules, vars(), globals(), sys.modules), so that it runs
# and meets the sandbox and the checking process.
SCOPE = {"05_fsdp": "{'torch': torch, 'dist': dist, 'fsdp': fsdp, 'nn': nn}", "09_context_parallel": "{'torch': torch}"}
FOUND = {"05_fsdp": "True", "09_context_parallel": "scope['merge']"}
HOLDER = {"05_fsdp": "type(self)", "09_context_parallel": "merge"}
USE_FOUND = {
    "05_fsdp": "if getattr(type(self), 'found', None):\n"
               "    shard.grad = fsdp.shard(p.grad / self.world_size, self.rank, self.world_size)\n",
    "09_context_parallel": "if getattr(merge, 'found', None):\n    return merge.found(out, lse, block_out, block_lse)\n",
}

ONCE = "import os as _os\nif not _os.path.exists(f'/tmp/tampered-{_os.getpid()}'):\n" \
       "    open(f'/tmp/tampered-{_os.getpid()}', 'w').close()\n"


def tampered(name, tamper):
    """The notebook's handed-in JSON, its first exercise wrong, `tamper` run (once per process) in that answer."""
    right, wrong, indent, _ = WRONG[name]
    body = "".join(f"    {line}\n" for line in tamper.strip("\n").splitlines())
    code = "".join(" " * indent + line + "\n" for line in (ONCE + body + USE_FOUND[name]).splitlines())
    return handed_in(name, replace={right: wrong + code if name == "05_fsdp" else code + wrong})


def read_solutions(name):
    """Looks for the worked notebook everywhere it might be: sys.path, the course's folders, the checkout's absolute
    path, through /proc/1/root and /proc/self/root, a symlink to it, and a bounded walk of the filesystem; runs its
    cell through a builtins lookup the guard cannot read."""
    return f'''
import builtins, json, os, pathlib, sys
import utils
candidates = [pathlib.Path(f) / "solutions" for f in sys.path]
candidates += [p / "solutions" for p in pathlib.Path(utils.__file__).parents]
candidates += [pathlib.Path(p) for p in ({str(ROOT / "solutions")!r}, "/proc/1/root{ROOT}/solutions",
                                         "/proc/self/root{ROOT}/solutions", "/proc/1/cwd/solutions")]
try:
    os.symlink({str(ROOT / "solutions")!r}, "linked")
    candidates.append(pathlib.Path("linked"))
except OSError:
    pass
for top, dirs, files in os.walk("/"):
    if top.count("/") > 3 or top.startswith(("/proc", "/sys", "/dev")):
        dirs[:] = []
    if "{name}.ipynb" in files:
        candidates.append(pathlib.Path(top))
for folder in candidates:
    try:
        cells = ["".join(c["source"]) for c in json.loads((folder / "{name}.ipynb").read_text())["cells"]]
    except (OSError, ValueError):
        continue
    scope = {SCOPE[name]}
    getattr(builtins, "ex" + "ec")(next(c for c in cells if "### BEGIN SOLUTION" in c), scope)
    {HOLDER[name]}.found = {FOUND[name]}
    break
'''


PATCH_CHECKS = '''
import builtins, sys
_set, _vars = getattr(builtins, "set" + "attr"), getattr(builtins, "va" + "rs")
for _n, _m in list(getattr(sys, "mod" + "ules").items()):
    if not _n.startswith(("utils.checks", "__main__")):
        continue
    for _n in [n for n in _vars(_m) if n.startswith(("check_", "_verify", "verify_", "max_abs_diff", "close"))]:
        _set(_m, _n, (lambda *a, **k: None) if "check" in _n or "verify" in _n
             else (lambda *a, **k: 0.0 if "diff" in _n else True))
_set(builtins, "print", lambda *a, **k: None)
'''
CUSTOM_EXC = '''
try:
    get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
except NameError:
    pass
'''
EVIL_RETURN = '''
import os, sys
class Evil:
    def __reduce__(self):
        return (os.system, ("touch /submission/pwned",))
for _f in range(1, 8):
    try:
        _l = sys._getframe(_f).f_locals
    except ValueError:
        break
    for _v in _l.values():
        if isinstance(_v, list):
            _v.append(Evil())
'''
LYING_COLLECTIVES = '''
import builtins
import torch.distributed as _d
_set = getattr(builtins, "set" + "attr")
for _name in ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "barrier"):
    _set(_d, _name, lambda *a, **k: None)
import torch as _t
_set(_t, "equal", lambda *a, **k: True)
_set(_t, "allclose", lambda *a, **k: True)
'''
CTYPES = '''
import ctypes, os
libc = ctypes.CDLL(None)
for pid in {os.getppid(), 1, 2, 3}:
    libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH: the checking process is not dumpable, no capability allows it
    try:
        with open(f"/proc/{pid}/mem", "r+b") as mem:
            mem.write(b"\\0")
    except OSError:
        pass
ctypes.c_int.from_address(id(1) + 24).value  # poke at the interpreter's own objects: harmless reads
'''
FORK_BOMB = '''
import os, time
if not os.path.exists("/tmp/bombed"):  # capped: once per slot, 40 sleepers, each in a session of its own
    open("/tmp/bombed", "w").close()
    for _ in range(40):
        if os.fork() == 0:
            os.setsid()
            time.sleep(300)
            os._exit(0)
'''


def daemon(csv, marker):
    script = (f"import os, time\nfor _ in range(200):\n    time.sleep(0.2)\n    if os.path.exists({str(csv)!r}):\n"
              f"        open({str(csv)!r}, 'a').write('mallory,05_fsdp,gather_parameters, Zero1AdamW,passed,1,1,\\n')\n")
    return f'''
import os, subprocess, sys
if not os.path.exists("/tmp/daemon"):
    open("/tmp/daemon", "w").close()
    subprocess.Popen([sys.executable, "-c", {script!r}, {marker!r}], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
'''


def overwrite(victim, runs):
    """Copies the blank student copy over another student's submission, writes into other slots' folders (the
    grader's temporary folder, and the runs the grader makes), and appends to the course's checks."""
    return f'''
import glob, os, pathlib, shutil, tempfile, utils
try:
    shutil.copy(pathlib.Path(utils.__file__).parent.parent / "notebooks" / "05_fsdp.ipynb", {str(victim)!r})
except OSError:
    pass
for folder in glob.glob({str(runs)!r} + "/*") + glob.glob(tempfile.gettempdir() + "/grade-*") + ["/submission/.."]:
    try:
        open(os.path.join(folder, "pwned"), "w").write("passed")
    except OSError:
        pass
try:
    open(pathlib.Path(utils.__file__).parent / "checks" / "fsdp.py", "a").write("\\n")
except OSError:
    pass
'''


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not sandbox.bwrap(), reason="bubblewrap is not installed")
def test_a_hidden_class_stand_in_gets_no_wrong_verdict(tmp_path, monkeypatch):
    csv, marker = tmp_path / "grades.csv", f"grading-daemon-{os.getpid()}"
    victim = tmp_path / "submitted" / "victor" / "05_fsdp.ipynb"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    before = checks_digest()
    fsdp = {
        "reads_solutions": read_solutions("05_fsdp"),
        "patches_checks": PATCH_CHECKS,
        "custom_exc": CUSTOM_EXC,
        "forged_reports": FORGE_REPORTS,
        "evil_return": EVIL_RETURN,
        "lying_collectives": LYING_COLLECTIVES,
        "ctypes": CTYPES,
        "fork_bomb": FORK_BOMB,
        "daemon": daemon(csv, marker),
        "overwriter": overwrite(victim, tmp_path / "runs"),
        "phone_home": phone_home(port),
    }
    context = {
        "reads_solutions": read_solutions("09_context_parallel"),
        "patches_checks": PATCH_CHECKS,
        "forged_reports": FORGE_REPORTS,
        "lying_collectives": LYING_COLLECTIVES,
        "ctypes": CTYPES,
        "fork_bomb": FORK_BOMB,
    }
    no_copy = {"        p.detach().copy_(fsdp.unpad(full, p.shape))\n": "        pass\n"}
    wrong_blockwise = {"            if not ra.visible(q_pos, k_pos, mask):\n                continue\n": ""}
    honest = {
        "alice": ("05_fsdp.ipynb", handed_in("05_fsdp")),
        "victor": ("05_fsdp.ipynb", handed_in("05_fsdp")),
        "gina": ("05_fsdp.ipynb", handed_in("05_fsdp", replace=no_copy)),  # gather_parameters wrong
        "carl": ("09_context_parallel.ipynb", handed_in("09_context_parallel")),
        "mona": ("09_context_parallel.ipynb", handed_in("09_context_parallel", replace={MERGE: MERGE_WRONG})),
        "bill": ("09_context_parallel.ipynb", handed_in("09_context_parallel", replace=wrong_blockwise)),
    }
    adversarial = {**{f"fsdp_{k}": ("05_fsdp.ipynb", tampered("05_fsdp", v)) for k, v in fsdp.items()},
                   **{f"cp_{k}": ("09_context_parallel.ipynb", tampered("09_context_parallel", v))
                      for k, v in context.items()}}
    write_class(tmp_path / "submitted", {**honest, **adversarial})
    victim_text = victim.read_text()
    rows, seconds, left = run_grader(tmp_path, monkeypatch, "--timeout", "900")
    wrong_verdicts = []
    for student, (filename, _) in adversarial.items():
        tampered_exercise = WRONG[filename.removesuffix(".ipynb")][3]
        row = next(r for r in rows[student] if r["exercise"] == tampered_exercise)
        if row["verdict"] == "passed" or row["points"] != "0":
            wrong_verdicts.append((student, row))
    for student in ("alice", "victor", "carl"):
        wrong_verdicts += [(student, r) for r in rows[student] if r["verdict"] != "passed"]
    # one wrong earlier exercise fails that exercise only; the later rows say the reference was used
    for student, wrong in (("gina", "gather_parameters, Zero1AdamW"), ("mona", "merge"),
                           ("bill", "blockwise_attention")):
        for r in rows[student]:
            if (r["exercise"] == wrong) == (r["verdict"] == "passed"):
                wrong_verdicts.append((student, r))
    print(f"hidden-class stand-in: {len(adversarial)} adversarial and {len(honest)} honest submissions graded in "
          f"{seconds:.0f} s; wrong verdicts: {len(wrong_verdicts)}")
    assert not wrong_verdicts, json.dumps(wrong_verdicts, indent=1)
    assert any("checked with the reference merge (yours: failed)" in r["message"] for r in rows["mona"])
    assert victim.read_text() == victim_text and checks_digest() == before
    time.sleep(1)  # the daemon, were it alive, appends every 0.2 s
    assert "mallory" not in csv.read_text()
    assert not left and not [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]
    assert not list((tmp_path / "runs").rglob("pwned"))
    with pytest.raises(BlockingIOError):
        listener.accept()
