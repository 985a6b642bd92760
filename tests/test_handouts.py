"""A handout cannot drift from its notebook: every measured number it quotes is in the notebook's stored run.

The rule a handout follows: a number with a decimal point (a time, a bandwidth, a ratio) appears, as
written, in its solution notebook's stored outputs or code. Pictures in fenced code blocks are
exempt; everything else, tables included, is checked. A number from another run, or an old one, fails.
"""
import re

import nbformat
import pytest

from utils.notebooks import ROOT

HANDOUTS = sorted((ROOT / "lectures").glob("*.md"))
DECIMAL = re.compile(r"(?<![\d.])\d+\.\d+(?![\d.])")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def notebook_text(path):
    """Everything the notebook's code cells hold: their source and their stored outputs."""
    parts = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        parts.append(cell.source)
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts += [str(v) for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return "\n".join(parts)


def quoted_numbers(markdown):
    return DECIMAL.findall(FENCED.sub("", markdown))


def test_the_rule_finds_decimals_outside_pictures():
    text = "ran in **0.100 s** (37x), torch 2.13.0\n```\n  1.25 ms in a picture\n```\nbus 1.05 GB/s"
    assert quoted_numbers(text) == ["0.100", "1.05"]


def test_every_handout_has_its_notebook():
    for handout in HANDOUTS:
        assert (ROOT / "solutions" / f"{handout.stem}.ipynb").exists(), f"{handout.name} has no solution notebook"


@pytest.mark.parametrize("handout", HANDOUTS, ids=[h.stem for h in HANDOUTS])
def test_every_number_in_a_handout_comes_from_its_notebooks_stored_run(handout):
    text = notebook_text(ROOT / "solutions" / f"{handout.stem}.ipynb")
    missing = sorted({n for n in quoted_numbers(handout.read_text()) if n not in text}, key=float)
    assert not missing, (f"{handout.name} quotes numbers that its notebook's stored run does not show: "
                         f"{', '.join(missing)}; quote the notebook's output, or re-run it and quote that")
