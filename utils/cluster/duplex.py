"""Does the link carry both directions at once? One message across (rank 0 on node 0 to rank 1 on node 1) against
one each way at the same time, timed in turns (utils.bench.interleaved_samples). On a full-duplex link both take
about as long; where the two directions take turns, both at once take about twice as long. Over a tbf-shaped veth
pair they take turns (measured: 11.2 ms one way, 21.9 ms both ways, for 128 KB over 100mbit): each direction's TCP
acknowledgements wait in the same queue as the other direction's data. The modeled clock's replay of a pipeline
step across the link (utils.cluster.pipeline_step.modeled) needs this fact.

This file is also the script torchrun runs on each node; rank 0 prints the result as JSON."""
import json
import sys
from pathlib import Path

from utils.cluster.run import run_for_json

LINK = "100mbit"
SCRIPT = Path(__file__)


def duplex_seconds(link=LINK, nbytes=128 * 1024, repeat=7):
    """{"one way": median seconds of one message across, "both ways": of one each way at once}, on 2 nodes x 1."""
    return run_for_json(2, 1, SCRIPT, [str(nbytes), str(repeat)], what="the duplex measurement", link=link,
                        timeout=300)


def main(nbytes, repeat):
    import torch
    import torch.distributed as dist

    from utils.bench import interleaved_seconds

    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    x, y = torch.zeros(nbytes // 8, dtype=torch.float64), torch.empty(nbytes // 8, dtype=torch.float64)

    def one_way():
        dist.send(x, peer) if rank == 0 else dist.recv(y, peer)

    def both_ways():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
            work.wait()

    seconds = interleaved_seconds({"one way": one_way, "both ways": both_ways}, repeat)
    if rank == 0:
        print(json.dumps(seconds))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
