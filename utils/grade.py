"""`python -m utils.grade`: the grading command under its first name (it lives in utils.grading.command)."""
import sys

from utils.grading.command import *  # noqa: F403 -- the command's names, for `from utils import grade`
from utils.grading.command import main

if __name__ == "__main__":
    sys.exit(main())
