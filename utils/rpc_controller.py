"""One controller over RPC (notebook 08, section 5): rank 0 drives the pipeline's stages, each on a worker of
its own, with remote modules, distributed autograd and a DistributedOptimizer.
"""
import dataclasses
import logging
import os
import tempfile
import warnings

import torch

from utils import pipeline as pp
from utils.launch import loopback_interface, spawn
from utils.model import step_batches
from utils.sizes import check_int


def stage_name(stage):
    return f"stage{stage}"


def parameter_rrefs(module_rref):
    """On the stage's worker: an RRef to each of its parameters (what DistributedOptimizer steps)."""
    from torch.distributed import rpc

    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def gradients_of(module_rref, context_id):
    """On the stage's worker: its parameters' gradients in distributed autograd context `context_id` (they are
    kept per context, not in .grad), None where a parameter got none."""
    import torch.distributed.autograd as dist_autograd

    grads = dist_autograd.get_gradients(context_id)
    return [None if p not in grads else grads[p].clone() for p in module_rref.local_value().parameters()]


def weights_of(module_rref):
    return [p.detach().clone() for p in module_rref.local_value().parameters()]


class SGD(torch.optim.SGD):
    """torch.optim.SGD under another name: DistributedOptimizer then runs the plain optimizer on each worker, as
    the single-process run does (for SGD itself it would script a functional one, and warn that it is
    deprecated)."""


class RecordingOptimizer:
    """A DistributedOptimizer that, at its first step, also fetches every stage's gradients (for the check)."""

    def __init__(self, stages, optimizer="sgd"):
        from torch.distributed import rpc
        from torch.distributed.optim import DistributedOptimizer

        params = [p for stage in stages for p in rpc.rpc_sync(stage.owner(), parameter_rrefs, args=(stage,))]
        self.stages, self.first_grads, self.steps = stages, None, 0
        if optimizer == "sgd":
            logger = logging.getLogger("torch.distributed.optim.optimizer")
            level = logger.level
            logger.setLevel(logging.ERROR)  # its warning: no TorchScript for this class (as wanted, see SGD)
            try:
                self.optimizer = DistributedOptimizer(SGD, params, lr=0.1, foreach=False)  # make_optimizer's SGD
            finally:
                logger.setLevel(level)
        else:
            raise ValueError(f"optimizer must be 'sgd', got {optimizer!r}")

    def step(self, context_id):
        from torch.distributed import rpc

        if self.first_grads is None:
            self.first_grads = [rpc.rpc_sync(s.owner(), gradients_of, args=(s, context_id)) for s in self.stages]
        self.steps += 1
        self.optimizer.step(context_id)


@dataclasses.dataclass
class ControllerRun:
    grads: list  # [stage][parameter]: step 0's gradients, None where a parameter got none
    weights: list  # [stage][parameter], after the last step
    losses: list  # what the student's step returned, by step
    optimizer_steps: int


def controller_main(rank, world_size, train_step, init_file, hidden_dim, num_layers, batch_size, num_steps,
                    num_micro_batches, seed=0):
    """Rank 0 is the controller, ranks 1..p the p = world_size - 1 stages (notebook 04's split). The controller
    builds each stage on its worker (rpc.remote), a DistributedOptimizer over their parameters, and calls
    `train_step(stages, optimizer, batch, num_micro_batches)` for each step; it returns a ControllerRun. The
    workers only serve: everything they run, the controller asks for."""
    from torch.distributed import rpc

    num_stages = world_size - 1
    pp.check_sizes(num_layers, num_stages, batch_size, num_micro_batches)
    os.environ.setdefault("TP_SOCKET_IFNAME", loopback_interface() or "lo")
    name = "controller" if rank == 0 else stage_name(rank - 1)
    with warnings.catch_warnings():  # init_rpc and DistributedOptimizer warn (deprecated, TorchScript): not here
        warnings.simplefilter("ignore")
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=f"file://{init_file}", _transports=["uv"]))
        run = None
        try:
            if rank == 0:
                stages = [rpc.remote(stage_name(s), pp.build_stage, args=(s, num_stages, hidden_dim, num_layers, seed))
                          for s in range(num_stages)]
                optimizer = RecordingOptimizer(stages)
                losses = [train_step(stages, optimizer, batch, num_micro_batches)
                          for batch in step_batches(batch_size, hidden_dim, seed, num_steps)]
                losses = [float(loss) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else loss
                          for loss in losses]
                run = ControllerRun(optimizer.first_grads, [rpc.rpc_sync(s.owner(), weights_of, args=(s,))
                                                            for s in stages], losses, optimizer.steps)
        finally:
            rpc.shutdown()
    return run


def run_controller(train_step, num_stages, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches,
                   seed=0, timeout=60.0):
    """The controller and `num_stages` stage workers on spawn's ranks (their RPC agents meet in a file of a
    temporary folder; TensorPipe on loopback): the controller's ControllerRun."""
    num_stages = check_int("num_stages", num_stages)
    with tempfile.TemporaryDirectory(prefix="rpc-") as folder:
        return spawn(controller_main, num_stages + 1, train_step, os.path.join(folder, "rpc_init"), hidden_dim,
                     num_layers, batch_size, num_steps, num_micro_batches, seed, timeout=timeout)[0]
