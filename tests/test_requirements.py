"""requirements.txt installs PyTorch's CPU build on Linux, never the CUDA toolkit (issue 46).

This machine reaches PyPI but not PyTorch's CPU index, so "resolves to the CPU build" is told from "would pull the
CUDA toolkit" with what is reachable:
- the markers: which torch line each platform gets, and that Linux x86_64's is pinned to the +cpu local version
  (offline);
- PyPI alone cannot satisfy that pin (PyPI accepts no local versions), so pip cannot fall back to PyPI's Linux
  wheel, which does pull the CUDA toolkit: the same check fails on the old `torch==2.13.0` (network: PyPI);
- the CPU wheel's own metadata requires no CUDA package: read from the copy in a find-links folder of this
  machine's pip (offline), and (-m slow) from PyTorch's CPU index where that is reachable;
- the environment set up from the file: its torch is the pinned build, and no CUDA package is installed;
- macOS and Windows get PyPI's wheel, whose requirements hold no CUDA package under that platform's markers.
pip evaluates markers for the machine it runs on, even with --platform; so each wheel is resolved alone
(--no-deps) and its Requires-Dist is evaluated here for the target platform.

The default run has the offline tests (about a second: the file, the installed environment, the CPU wheel's
metadata, the catalogue of wrong files). The tests that ask PyPI are marked slow: each pip call reads PyPI's
listing of torch's thousands of files, 1 to 10 s here, and `test_setup_resolves_here` resolves the whole file as
the set-up does on this machine (minutes).

The resolutions run pip with no configuration at all (PIP_CONFIG_FILE=/dev/null drops every config file, --isolated
the PIP_* variables): this machine's pip finds the CPU wheel in a local folder, which is how the old file's CUDA
build stayed hidden here. Where PyPI is unreachable those tests skip and say so.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA = re.compile(r"nvidia-.*|cuda-.*|triton")  # what PyPI's Linux torch wheel requires (canonical names)

# Marker environments (PEP 508), and pip's platform tag for the wheel each one installs.
PLATFORMS = {
    "Linux x86_64": ({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                      "os_name": "posix"}, "manylinux_2_28_x86_64"),
    "Linux aarch64": ({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64",
                       "os_name": "posix"}, "manylinux_2_28_aarch64"),
    "macOS arm64": ({"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64",
                     "os_name": "posix"}, "macosx_14_0_arm64"),
    "Windows": ({"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64",
                 "os_name": "nt"}, "win_amd64"),
}
PYTHON = "3.11"  # the Python the course is tested on


def parse(text):
    """requirements.txt's requirements, and its extra index URLs."""
    requirements, extra_indexes = [], []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line.startswith("--extra-index-url"):
            extra_indexes.append(line.split(maxsplit=1)[1])
        elif line and not line.startswith(("#", "-")):
            requirements.append(Requirement(line))
    return requirements, extra_indexes


def environment(platform):
    return {**PLATFORMS[platform][0], "python_version": PYTHON, "python_full_version": f"{PYTHON}.0", "extra": ""}


def holds(requirement, platform):
    return requirement.marker is None or requirement.marker.evaluate(environment(platform))


def holds_here(requirement):
    return requirement.marker is None or requirement.marker.evaluate()


def torch_for(text, platform):
    """The one torch requirement whose marker holds on `platform`."""
    lines = [r for r in parse(text)[0] if r.name == "torch" and holds(r, platform)]
    assert len(lines) == 1, f"{len(lines)} torch lines hold on {platform}: {[str(r) for r in lines]}; want one"
    return lines[0]


def cuda_packages(requires_dist, platform):
    """The CUDA packages a wheel with this Requires-Dist pulls on `platform`."""
    wanted = (Requirement(line) for line in requires_dist)
    return sorted(str(canonicalize_name(r.name)) for r in wanted
                  if holds(r, platform) and CUDA.fullmatch(canonicalize_name(r.name)))


def resolve(requirement, platform, index=None):
    """The metadata of the wheel pip picks for `requirement` on `platform` (PyPI, or `index` alone), ignoring every
    pip configuration; None when the index has no such version. Skips when the index cannot be reached."""
    pip = [sys.executable, "-m", "pip", "--isolated", "install", "--disable-pip-version-check", "--dry-run",
           "--ignore-installed", "--no-deps", "--only-binary=:all:", "--platform", PLATFORMS[platform][1],
           "--python-version", PYTHON, "--target", str(Path(tempfile.gettempdir(), "never-written")),  # pip wants
           "--retries", "0", "--timeout", "15", "--quiet", "--report", "-"]               # one with --platform
    pip += ["--index-url", index] if index else []
    run = subprocess.run([*pip, str(Requirement(f"{requirement.name}{requirement.specifier}"))],
                         capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    if run.returncode == 0:
        return json.loads(run.stdout)["install"][0]["metadata"]
    if "(from versions: none)" in run.stderr:  # no listing at all: the index was not reached
        pytest.skip(f"{index or 'PyPI'} unreachable: {run.stderr.strip().splitlines()[0]}")
    assert "No matching distribution" in run.stderr, run.stderr
    return None


def check_structure(text):
    """What the file must say, read without a network: the CPU index, and the +cpu pin on Linux x86_64."""
    extra_indexes = parse(text)[1]
    torch = torch_for(text, "Linux x86_64")
    pins = [Version(s.version) for s in torch.specifier if s.operator == "=="]
    assert pins and all(pin.local == "cpu" for pin in pins), (
        f"Linux x86_64 gets {torch}, which PyPI's CUDA wheel satisfies (it requires the CUDA 13 toolkit): "
        "pin PyTorch's CPU build, torch==X.Y.Z+cpu")
    assert CPU_INDEX in extra_indexes, (
        f"torch{torch.specifier} is published on PyTorch's CPU index only: add --extra-index-url {CPU_INDEX}")
    for platform in PLATFORMS:
        torch_for(text, platform)


def check_no_cuda_from_pypi(text):
    """PyPI cannot give Linux x86_64 its torch as a CUDA build; macOS and Windows get PyPI's wheel, a CPU build."""
    torch = torch_for(text, "Linux x86_64")
    wheel = resolve(torch, "Linux x86_64")
    if wheel is not None:
        found = cuda_packages(wheel.get("requires_dist", []), "Linux x86_64")
        assert not found, f"on Linux x86_64, {torch} resolves on PyPI to the CUDA build: it pulls {', '.join(found)}"
    for platform in ("macOS arm64", "Windows"):
        torch = torch_for(text, platform)
        wheel = resolve(torch, platform)
        assert wheel is not None, f"PyPI has no wheel of {torch} for {platform}"
        found = cuda_packages(wheel.get("requires_dist", []), platform)
        assert not found, f"on {platform}, {torch} pulls {', '.join(found)}"


def find_links_folders():
    """The local folders this machine's pip is told to look in for wheels (find-links), if any."""
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    values = re.findall(r"find-links='([^']*)'", config)
    return [Path(folder) for value in values for folder in value.split() if Path(folder).is_dir()]


def local_cpu_wheel(version):
    """The Requires-Dist of PyTorch's CPU wheel `version` for Linux x86_64 in a find-links folder, and its path."""
    name = f"torch-{version}-cp{PYTHON.replace('.', '')}-*x86_64.whl"
    for wheel in (w for folder in find_links_folders() for w in sorted(folder.glob(name))):
        with zipfile.ZipFile(wheel) as archive:
            text = archive.read(f"torch-{version}.dist-info/METADATA").decode()
        return re.findall(r"^Requires-Dist: (.*)$", text, re.MULTILINE), wheel
    pytest.skip(f"no find-links folder of this machine's pip holds {name}: -m slow reads PyTorch's CPU index")


def linux_pin():
    (pin,) = torch_for(REQUIREMENTS.read_text(), "Linux x86_64").specifier
    return pin.version


# the right answer


def test_structure():
    check_structure(REQUIREMENTS.read_text())


def test_installed_torch_is_the_pinned_build():
    """This environment, set up from the file: its torch is the line for this platform, and no CUDA package came."""
    (torch,) = [r for r in parse(REQUIREMENTS.read_text())[0] if r.name == "torch" and holds_here(r)]
    assert torch.specifier.contains(metadata.version("torch"), prereleases=True), (
        f"torch {metadata.version('torch')} is installed, requirements.txt asks for {torch}: "
        "run pip install -r requirements.txt again")
    names = {str(canonicalize_name(d.metadata["Name"])) for d in metadata.distributions() if d.metadata["Name"]}
    assert sorted(filter(CUDA.fullmatch, names)) == [], "CUDA packages are installed"


def test_cpu_wheel_requires_no_cuda():
    requires_dist, wheel = local_cpu_wheel(linux_pin())
    assert "filelock" in " ".join(requires_dist), f"no Requires-Dist read from {wheel}"
    assert cuda_packages(requires_dist, "Linux x86_64") == [], wheel


@pytest.mark.slow
def test_cpu_index_wheel_requires_no_cuda():
    """The same wheel's metadata as PyTorch's CPU index serves it (skips where that index is unreachable)."""
    found = resolve(Requirement(f"torch=={linux_pin()}"), "Linux x86_64", index=CPU_INDEX)
    assert found is not None, f"PyTorch's CPU index has no torch {linux_pin()} for Linux x86_64, Python {PYTHON}"
    assert cuda_packages(found.get("requires_dist", []), "Linux x86_64") == []


@pytest.mark.slow
def test_no_cuda_from_pypi():
    check_no_cuda_from_pypi(REQUIREMENTS.read_text())


@pytest.mark.slow
def test_setup_resolves_here():
    """The set-up's own resolution on this machine, with its pip configuration (the CPU wheel comes from a local
    folder or from PyTorch's index): torch is the pinned build, and nothing from the CUDA toolkit comes along.
    --retries 1: pip retries an unreachable index 5 times with back-off, 7.5 s for each of ~120 packages."""
    text = REQUIREMENTS.read_text().replace("-e .", "")  # this folder's own metadata changes nothing here
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--retries", "1",
                          "--quiet", "--report", "-", "-r", "/dev/stdin"], input=text, capture_output=True, text=True)
    if "No matching distribution found for torch" in run.stderr:
        pytest.skip(f"neither PyTorch's CPU index nor a local copy has the pinned torch: {run.stderr.splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    installed = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                 for item in json.loads(run.stdout)["install"]}
    (torch,) = [r for r in parse(text)[0] if r.name == "torch" and holds_here(r)]
    assert torch.specifier.contains(installed["torch"], prereleases=True), installed["torch"]
    assert [name for name in installed if CUDA.fullmatch(name)] == []


# the wrong answers: each fails with a hint that names it

OLD = "torch==2.13.0\n"  # the file before issue 46: PyPI's Linux wheel, the CUDA build
NO_INDEX = 'torch==2.13.0+cpu ; sys_platform == "linux"\ntorch==2.13.0 ; sys_platform != "linux"\n'
CPU_LINES = f"--extra-index-url {CPU_INDEX}\n" + NO_INDEX


@pytest.mark.parametrize("text, hint", [
    (OLD, "pin PyTorch's CPU build"),
    (f"--extra-index-url {CPU_INDEX}\ntorch\n", "pin PyTorch's CPU build"),  # PyPI's, if that index is unreachable
    (NO_INDEX, "add --extra-index-url"),
    (CPU_LINES + 'torch==2.13.0 ; platform_machine == "arm64"\n', "2 torch lines hold on macOS arm64"),
    (f"--extra-index-url {CPU_INDEX}\n"
     'torch==2.13.0+cpu ; sys_platform == "linux"\n', "0 torch lines hold on macOS"),
], ids=["old file", "unpinned", "no CPU index", "two lines on macOS", "none on macOS"])
def test_structure_catalogue(text, hint):
    with pytest.raises(AssertionError, match=re.escape(hint)):
        check_structure(text)


@pytest.mark.slow
def test_old_file_pulls_cuda_from_pypi():
    """The check tells the CPU build from the CUDA one: PyPI's wheel for the old pin pulls the toolkit."""
    with pytest.raises(AssertionError, match=r"resolves on PyPI to the CUDA build: it pulls cuda-bindings, .*nvidia-"):
        check_no_cuda_from_pypi(OLD)


@pytest.mark.slow
def test_cpu_pin_everywhere_fails_on_macos():
    with pytest.raises(AssertionError, match="PyPI has no wheel of torch==2.13.0\\+cpu for macOS arm64"):
        check_no_cuda_from_pypi(f"--extra-index-url {CPU_INDEX}\ntorch==2.13.0+cpu\n")
