"""Two nodes on one machine: network namespaces joined by a bridge, the link between them shaped by tc, torchrun
in each (`python -m utils.cluster up | run | bench | status | down`). One module per concern: network (the
namespaces, links and their shaping), run (torchrun across the nodes), bench (the link, measured)."""
