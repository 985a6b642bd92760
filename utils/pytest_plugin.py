"""The course's pytest settings that take code, loaded first (`-p utils.pytest_plugin` in pyproject.toml).

- How many workers `-n auto` starts (pytest-xdist): two for the suite (a folder, or several files), since one
  alone leaves a core of two idle (8.5 min instead of 5 here); none for a single file, such as the notebook a
  student checks: starting two workers costs about 4 s, more than they could save on one notebook, whose cells
  run in order in one kernel.
- No IRI grammar: nbval imports nbformat, which imports jsonschema, which builds a parser for RFC 3987 (IRIs)
  on import if rfc3987_syntax is installed (jupyter's dependencies install it): 1.5 s of every pytest start,
  for a format no notebook schema uses. This plugin loads before nbval, so jsonschema finds it unavailable.
- A kernel that dies at its start is started again (twice at most): jupyter_client picks a kernel's five TCP ports
  by binding port 0 and closing the socket, and until the kernel binds them any process may take one (here the
  other worker's ranks, whose gloo connections take ephemeral ports): the kernel then dies with "Address already
  in use" before its first reply. A new start picks new ports.
"""
import functools
import sys
from pathlib import Path

sys.modules.setdefault("rfc3987_syntax", None)  # None in sys.modules: `import rfc3987_syntax` raises ImportError

KERNEL_STARTS = 3
KERNEL_DIED = "died before replying"  # jupyter_client's RuntimeError: "Kernel died before replying to kernel_info"


def retry_kernel_start(start):
    """`start` (which starts a kernel and waits for its first reply), tried up to KERNEL_STARTS times."""
    @functools.wraps(start)
    def start_again_if_it_died(*args, **kwargs):
        for attempt in range(1, KERNEL_STARTS + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError as e:
                if KERNEL_DIED not in str(e) or attempt == KERNEL_STARTS:
                    raise
    return start_again_if_it_died


def pytest_configure(config):
    import nbval.kernel
    nbval.kernel.start_new_kernel = retry_kernel_start(nbval.kernel.start_new_kernel)


def pytest_xdist_auto_num_workers(config):
    paths = {Path(arg.split("::")[0]) for arg in config.args}
    return 2 if len(paths) > 1 or any(p.is_dir() for p in paths) else 0
