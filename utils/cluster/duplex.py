"""Does the link carry both directions at once? On 2 nodes x 2 ranks (ranks 0, 1 on node 0; 2, 3 on node 1), timed
in turns (utils.bench.interleaved_samples):
- one way: one message from rank 0 to rank 2;
- both ways, two pairs: rank 0 to rank 2 and rank 3 to rank 1 at once, each on its own gloo pair (TCP socket);
- both ways, one pair: ranks 0 and 2 send each other one at once, on their one pair.
On a full-duplex link the first two take about as long. Measured over 100mbit, 128 KB: 10.8 ms one way; both ways on
two pairs 11.1-17.9 ms (15.8-18.1 ms behind a plain tbf's deep queue, before utils.cluster.network put
acknowledgements first: gloo's own small notices, data to TCP, still wait behind the other pair's data); both ways
on one pair 21.3 ms, with either. The link carries both directions; gloo's pair does not. A gloo send writes its
data only once the receiver has said it posted its receive (NOTIFY_RECV_READY), and a pair writes everything,
notices and data, in order on its one socket: the peer's notice waits behind the peer's own data, so two ranks that
send each other at once take turns (gloo's transport/tcp/pair.cc). A pipeline's activation and gradient cross
between the same two ranks, so the modeled clock's replay of a step across the link
(utils.cluster.pipeline_step.modeled) carries one hand-off at a time.

This file is also the script torchrun runs on each node; rank 0 prints the result as JSON."""
import json
import sys
from pathlib import Path

from utils.cluster.run import run_for_json

LINK = "100mbit"
SCRIPT = Path(__file__)
SENDS = {"one way": [(0, 2)], "both ways, two pairs": [(0, 2), (3, 1)], "both ways, one pair": [(0, 2), (2, 0)]}


def duplex_seconds(link=LINK, nbytes=128 * 1024, repeat=7):
    """{variant of SENDS: median seconds, its slowest rank's}, on 2 nodes x 2."""
    return run_for_json(2, 2, SCRIPT, [str(nbytes), str(repeat)], what="the duplex measurement", link=link,
                        timeout=300)


def main(nbytes, repeat):
    import torch
    import torch.distributed as dist

    from utils.bench import interleaved_seconds

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = torch.zeros(nbytes // 8, dtype=torch.float64), torch.empty(nbytes // 8, dtype=torch.float64)

    def exchange(sends):
        ops = [dist.P2POp(dist.isend, x, dst) for src, dst in sends if src == rank] + \
              [dist.P2POp(dist.irecv, y, src) for src, dst in sends if dst == rank]
        return lambda: [work.wait() for work in dist.batch_isend_irecv(ops)] if ops else None

    seconds = interleaved_seconds({name: exchange(sends) for name, sends in SENDS.items()}, repeat)
    if rank == 0:
        print(json.dumps(seconds))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
