"""pytest settings that take code: how many workers pyproject.toml's `-n auto` starts (pytest-xdist)."""
from pathlib import Path


def pytest_xdist_auto_num_workers(config):
    """The suite (a folder, or several files) on two workers: one alone leaves a core of two idle (8.5 min
    instead of 5). One file, such as the notebook a student checks, in this process: starting two workers
    costs about 4 s, more than they could save on one notebook, whose cells run in order in one kernel."""
    paths = {Path(arg.split("::")[0]) for arg in config.args}
    return 2 if len(paths) > 1 or any(p.is_dir() for p in paths) else 0
