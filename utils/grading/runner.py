"""The checking process: runs a graded notebook's cells as the grader sends them, and reports how each ended.

    python -P -m utils.grading.runner          (started by utils.grading.sandbox, in the sandbox)

Cells arrive one JSON line at a time on stdin: {"index": i, "source": ..., "guard": [names]}; after each, one JSON
line goes back on the report pipe (the file descriptor in $GRADING_REPORT_FD): {"index": i, "error": null or
[exception name, message], "wire": the TCP segments sent while it ran (utils.grading.wire; null unless
$GRADING_WIRE says the network namespace is the sandbox's own)}. No line of a student's runs in this process: an
answer cell only defines functions and classes (utils.grading.submission.answer_outside_functions refuses the
rest before it is sent), and the functions and methods holding the student's lines are then guarded (`guard`):
called here, they run in a fork, and only what they return or raise comes back. The student's code runs in the ranks the checks start (forks of
this process), which report back through files that are read here with a pickle that builds data only
(safe_load, which pickle.load and pickle.loads are in this process): tensors, containers, the course's
classes; never a function.

What a rank could use to reach this process is closed before a rank starts: the cell pipe and the report pipe are
closed in every fork (os.register_at_fork) and not inherited by programs it starts; this process is not dumpable
(no ptrace, no /proc/<pid>/mem for the ranks); the reference answers arrive only after the student's exercise is
checked, so a rank cannot find them in the memory it inherits.
"""
import builtins
import collections
import copyreg
import ctypes
import functools
import io
import json
import os
import pickle
import sys
import traceback
import types

from utils.grading import wire

PR_SET_DUMPABLE = 4


def guard(function, name):
    """`function`, which in this process runs only in a fork of it (in the ranks, as it is): what it returns or
    raises comes back as data, its other effects stay in the fork (a check may call a constructor here, to see
    that it refuses bad input)."""
    checker = os.getpid()

    @functools.wraps(function)
    def guarded(*args, **kwargs):
        if os.getpid() != checker:
            return function(*args, **kwargs)
        return call_in_fork(function, args, kwargs, name)
    return guarded


def call_in_fork(function, args, kwargs, name):
    """function(*args, **kwargs) run in a fork; what it returned (or raised) and what it did to its arguments'
    tensors and plain attributes (a constructor's self, a gradient divided in place) come back as data."""
    import cloudpickle
    tensors, objects = reachable((args, kwargs))

    def report():  # in the fork: run, then what came of it as bytes
        try:
            before = [dict(vars(o)) for o in objects]
            try:
                outcome = ("ok", function(*args, **kwargs))
            except Exception as e:
                outcome = ("raised", type(e).__name__, str(e))
            effects = ([(t.detach(), t.grad) for t in tensors],
                       [{k: v for k, v in vars(o).items() if (k not in was or v is not was[k]) and plain(v)}
                        for o, was in zip(objects, before)])
            return cloudpickle.dumps((outcome, effects))
        except BaseException as e:  # noqa: B036 -- whatever happens, the fork ends with a report
            return pickle.dumps((("raised", "RuntimeError", f"{name}'s result cannot be sent back: {e!r}"), None))

    data = in_fork(report)
    try:
        outcome, effects = safe_load(io.BytesIO(data))
    except Exception as e:
        raise RuntimeError(f"{name} (run apart from the checks) ended without a report it could send: {e}") from None
    if effects:
        replay(tensors, objects, *effects)
    if outcome[0] == "ok":
        return outcome[1]
    kind = getattr(builtins, outcome[1], None)
    kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
    raise kind(outcome[2])


def reachable(roots, depth=4):
    """The tensors and the plain objects (with a __dict__) reachable from roots: through containers, modules'
    parameters and buffers, optimizers' parameters and objects' attributes."""
    torch = sys.modules.get("torch")
    tensors, objects, seen = [], [], set()

    def visit(x, depth):
        if id(x) in seen or depth < 0:
            return
        seen.add(id(x))
        if torch and isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, (list, tuple, set, frozenset)):
            for y in x:
                visit(y, depth - 1)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y, depth - 1)
        elif torch and isinstance(x, torch.nn.Module):
            for y in [*x.parameters(), *x.buffers()]:
                visit(y, depth - 1)
        elif torch and isinstance(x, torch.optim.Optimizer):
            for group in x.param_groups:
                visit(group["params"], depth - 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, types.FunctionType, types.ModuleType,
                                                           types.MethodType, functools.partial)):
            objects.append(x)
            for y in vars(x).values():
                visit(y, depth - 1)
    visit(roots, depth)
    return tensors, objects


def plain(value):
    """Data a fork may send back: numbers, strings, tensors, dtypes, and containers of them."""
    torch = sys.modules.get("torch")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if torch and isinstance(value, (torch.Tensor, torch.dtype)):
        return True
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    return False


def replay(tensors, objects, tensor_states, object_states):
    """What the fork did, done here: each tensor's values and gradient, each object's plain attributes it set."""
    import torch
    for t, (data, grad) in zip(tensors, tensor_states):
        with torch.no_grad():
            if data.shape == t.shape and data.dtype == t.dtype:
                t.copy_(data)
            else:
                t.data = data
        if t.is_leaf and (grad is not None or t.grad is not None):
            t.grad = grad
    for o, state in zip(objects, object_states):
        for k, v in state.items():
            setattr(o, k, v)


def guard_names(namespace, names):
    """Guard the functions `names` (top-level ones, or "Class.method") of the namespace."""
    for name in names:
        owner_name, _, attribute = name.rpartition(".")
        owner = namespace[owner_name] if owner_name else None
        if owner is None:
            namespace[name] = guard(namespace[name], name)
            continue
        value = owner.__dict__[attribute]
        if isinstance(value, (staticmethod, classmethod)):
            setattr(owner, attribute, type(value)(guard(value.__func__, name)))
        elif isinstance(value, property):
            setattr(owner, attribute, property(*(f and guard(f, name) for f in (value.fget, value.fset, value.fdel))))
        else:
            setattr(owner, attribute, guard(value, name))


SAFE_BUILTINS = {"list", "dict", "set", "frozenset", "tuple", "int", "float", "complex", "str", "bytes", "bytearray",
                 "bool", "slice", "range", "object", "NoneType", "Ellipsis", "NotImplemented"}


def _get_layout(name):
    import torch
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"not a layout: {name!r}")
    return value


def _storage_from_bytes(data):
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


class DataUnpickler(pickle.Unpickler):
    """A pickle that builds data only: containers, tensors, dtypes, and classes from the course and torch."""

    def find_class(self, module, name):
        if module == "builtins" and (name in SAFE_BUILTINS or isinstance(getattr(builtins, name, None), type) and
                                     issubclass(getattr(builtins, name), BaseException)):
            return getattr(builtins, name)
        if module == "traceback" and name in {"TracebackException", "StackSummary", "FrameSummary"}:
            return getattr(traceback, name)  # how a rank's failure is reported
        if (module, name) in {("copyreg", "_reconstructor"), ("copyreg", "__newobj__")}:
            return getattr(copyreg, name)
        if module == "collections" and name in {"OrderedDict", "defaultdict", "deque", "Counter"}:
            return getattr(collections, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name
            return _get_layout
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes  # torch's own loads any pickle
        if module.split(".")[0] == "torch" and name.startswith("_rebuild"):  # what they call is found here too
            __import__(module)
            return getattr(sys.modules[module], name)
        if module.split(".")[0] in {"torch", "utils", "numpy"}:
            __import__(module)
            value = getattr(sys.modules[module], name)
            import torch
            if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
                return value
            if isinstance(value, type) and (module.split(".")[0] != "utils" or module.startswith("utils.")):
                return value
        raise pickle.UnpicklingError(f"a rank returned {module}.{name}, which the grader does not load")


def safe_load(file):
    return DataUnpickler(file).load()


def read_pickles_as_data():
    """pickle.load and pickle.loads, in this process only, build data only: whatever this process reads with them
    (the ranks' reports, utils.launch) was written by processes that ran the student's code. The ranks, forks of
    this process, keep pickle's own (they load the functions a check sends them)."""
    checker, load, loads = os.getpid(), pickle.load, pickle.loads
    pickle.load = lambda file, **kw: safe_load(file) if os.getpid() == checker else load(file, **kw)
    pickle.loads = lambda data, **kw: safe_load(io.BytesIO(data)) if os.getpid() == checker else loads(data, **kw)


def run_in_fork(code, namespace):
    """Run a cell in a fork of this process, where the student's functions run as they are (a demo after a check
    that calls an autograd Function in its own process: utils.grading.submission.DEMOS_IN_A_FORK): its outcome,
    [name, message] or None, comes back through a pipe of its own, which its ranks do not hold. The fork ran the
    student's code: the outcome of this one cell could be forged, never the check cell's (run here), and the cell's
    definitions stay in the fork."""
    def report():  # in the fork: the cell's outcome, whatever it is
        error = None
        try:
            exec(code, namespace)
        except BaseException as e:  # noqa: B036
            error = [type(e).__name__, str(e)]
        return json.dumps(error).encode()

    data = in_fork(report)
    try:
        return json.loads(data)
    except ValueError:
        return ["RuntimeError", "the check's fork ended without a report"]


def in_fork(report):
    """report() run in a fork of this process, which then ends without Python's teardown; the bytes it returns come
    back through a pipe of their own, which no process the fork starts (its ranks) holds."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            close_in_forks(write_end)
            data = report()
            with os.fdopen(write_end, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return data


def close_in_forks(*fds):
    """Close the file descriptors fds in every fork of this process. Only in its own forks: a fork of a fork (a rank
    that a demo's fork starts) inherits the hook too, but there the numbers were closed one fork earlier and may
    have been reused since (closed again, a rank's store socket or result pipe went: "Bad file descriptor", or gloo
    aborting the rank)."""
    owner, forking_from = os.getpid(), [None]

    def note_parent():
        forking_from[0] = os.getpid()

    def close():
        if forking_from[0] != owner:
            return
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
    os.register_at_fork(before=note_parent, after_in_child=close)


def main():
    cells_fd = os.dup(0)  # the cell pipe and the report pipe: held by this process only
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    report_fd = int(os.environ.pop("GRADING_REPORT_FD"))
    for fd in (cells_fd, report_fd):
        os.set_inheritable(fd, False)
    close_in_forks(cells_fd, report_fd)
    try:
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the sandbox is not either
        pass
    read_pickles_as_data()
    counted = os.environ.pop("GRADING_WIRE", None) == "1"
    cells, reports = os.fdopen(cells_fd, "r"), os.fdopen(report_fd, "w", buffering=1)
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    namespace["__builtins__"] = builtins
    for line in cells:
        cell = json.loads(line)
        error, before = None, wire.counters() if counted else None
        code = compile(cell["source"], f"<cell {cell['index']}>", "exec")
        if cell.get("fork"):
            error = run_in_fork(code, namespace)
        else:
            try:
                exec(code, namespace)
                guard_names(namespace, cell.get("guard", []))
            except BaseException as e:  # noqa: B036 -- the cell's outcome, whatever it is, is the report
                error = [type(e).__name__, str(e)]
        sys.stdout.flush()
        reports.write(json.dumps({"index": cell["index"], "error": error, "wire": wire.since(before)}) + "\n")


if __name__ == "__main__":
    main()
