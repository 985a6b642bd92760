"""The course's pytest settings that take code, loaded first (`-p utils.pytest_plugin` in pyproject.toml).

- How many workers `-n auto` starts (pytest-xdist): two for the suite (a folder, or several files), since one
  alone leaves a core of two idle (8.5 min instead of 5 here); none for a single file, such as the notebook a
  student checks: starting two workers costs about 4 s, more than they could save on one notebook, whose cells
  run in order in one kernel.
- No IRI grammar: nbval imports nbformat, which imports jsonschema, which builds a parser for RFC 3987 (IRIs)
  on import if rfc3987_syntax is installed (jupyter's dependencies install it): 1.5 s of every pytest start,
  for a format no notebook schema uses. This plugin loads before nbval, so jsonschema finds it unavailable.
- nbval's kernels are started again if they die at their start (utils.notebooks.retry_kernel_start says why).
- The solutions' timing cells (tag `nbval-ignore-output`) are skipped in the default run (`-m 'not slow'`): their
  outputs are not compared anyway, no other cell needs them (the student-copy and mutation runs leave them out
  too), and they are a minute of the default run's six. `pytest -m slow` runs every solution, timing cells
  included, with spawn on 2 ranks and under torchrun; they also run when a notebook is executed, and in a
  student's `--nbval-lax` run of notebooks/.
- So are the solutions' cells tagged `slow`: cells whose outputs are compared, but only by `pytest -m slow`'s strict
  nbval run (spawn, `-m ''`: every cell), for the default run cannot pay for them (08's torchrun restart, 20 s: the
  default run checks its latest_checkpoint, the slow run the restart, in that cell and in its own test). As for
  timing cells, no other cell may use what they define.
"""
import sys
from pathlib import Path

import pytest

SLOW = "slow"  # a solution cell the default run skips (its output is compared under pytest -m slow)

sys.modules.setdefault("rfc3987_syntax", None)  # None in sys.modules: `import rfc3987_syntax` raises ImportError


def pytest_configure(config):
    import nbval.kernel

    from utils.notebooks import retry_kernel_start
    nbval.kernel.start_new_kernel = retry_kernel_start(nbval.kernel.start_new_kernel)


@pytest.hookimpl(tryfirst=True)  # before xdist's own (one per core): this plugin registers before xdist
def pytest_xdist_auto_num_workers(config):
    paths = {Path(arg.split("::")[0]) for arg in config.args}
    return 2 if len(paths) > 1 or any(p.is_dir() for p in paths) else 0


def pytest_collection_modifyitems(config, items):
    if config.option.markexpr != "not slow":
        return
    from utils.notebooks import TIMING
    reasons = {TIMING: "a timing cell: it runs under pytest -m slow", SLOW: "a slow cell: it runs under pytest -m slow"}
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's cells
        if cell is not None and Path(str(item.fspath)).parent.name == "solutions":
            for tag in set(reasons) & set(cell.metadata.get("tags", [])):
                item.add_marker(pytest.mark.skip(reason=reasons[tag]))
