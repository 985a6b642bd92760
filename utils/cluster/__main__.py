"""python -m utils.cluster up --nodes N --link RATE [--delay D] | run --nodes N --nproc-per-node K SCRIPT [ARGS]
| bench | status | down. Needs Linux and root (or a user namespace of your own: see the README)."""
import argparse
import sys

from utils.cluster import network
from utils.cluster.network import ClusterError


def parser():
    p = argparse.ArgumentParser(prog="python -m utils.cluster", description=__doc__.splitlines()[0])
    verbs = p.add_subparsers(dest="verb", required=True)

    def link_options(verb):
        verb.add_argument("--link", default="1gbit", help="bandwidth between nodes, each way (tc units: 100mbit, "
                                                          "1gbit; default 1gbit)")
        verb.add_argument("--delay", help="one-way latency between nodes (5ms), where the kernel has netem")

    up = verbs.add_parser("up", help="make N nodes joined by a shaped link")
    up.add_argument("--nodes", type=int, default=2)
    link_options(up)
    run = verbs.add_parser("run", help="run a script with torchrun on every node",
                           description="On the cluster `up` made, or on a temporary one (--link, --delay) removed "
                                       "afterwards.")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--nproc-per-node", type=int, default=2)
    run.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)")
    link_options(run)
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    bench = verbs.add_parser("bench", help="measure the link: point-to-point inside a node and across nodes")
    link_options(bench)
    verbs.add_parser("status", help="what is up")
    verbs.add_parser("down", help="remove every namespace, interface, qdisc and process of ours")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        if args.verb == "up":
            network.up(args.nodes, args.link, args.delay)
        elif args.verb == "down":
            network.down()
        elif args.verb == "status":
            network.status()
        elif args.verb == "run":
            from utils.cluster.run import run
            return run(args.nodes, args.nproc_per_node, args.script, args.args, args.link, args.delay,
                       args.timeout)[0]
        elif args.verb == "bench":
            network.require_privileges()  # before importing torch (seconds), to refuse at once
            from utils.cluster.bench import bench
            bench(args.link, args.delay)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopped and cleaned up", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
