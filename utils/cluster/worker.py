"""What every rank of `python -m utils.cluster run` starts: the script, as `python SCRIPT ARGS` would run it, with
this rank's output (file descriptors 1 and 2, so C++ warnings too) in files named after its node and global rank.
Not torchrun's --tee: it copies each rank's lines to one console as they come, and a rank's half-written line
takes the next rank's line into it (seen: one line in a few hundred lost to its neighbour)."""
import os
import runpy
import sys

folder, node, rank = os.environ["DTFS_RUN_LOGS"], os.environ["DTFS_NODE"], os.environ["RANK"]
for fd, stream in ((1, "out"), (2, "err")):
    file = os.open(os.path.join(folder, f"node{node}.rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(file, fd)
    os.close(file)
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
