"""The script `python -m utils.cluster bench` runs under torchrun on two ranks (argv: message sizes in bytes): the
one-way time of each size between ranks 0 and 1 (utils.bench.ping_pong_main), fitted to alpha + size / beta.
Rank 0 prints the fit as one line of JSON."""
import json
import os
import sys

from utils.bench import fit_alpha_beta, ping_pong_main
from utils.launch import spawn

sizes = [int(size) for size in sys.argv[1:]]
seconds = spawn(ping_pong_main, 2, sizes, timeout=300)[0]
alpha, beta = fit_alpha_beta(sizes, seconds)
if os.environ["RANK"] == "0":
    print(json.dumps({"alpha": alpha, "beta": beta, "sizes": sizes, "seconds": seconds}))
