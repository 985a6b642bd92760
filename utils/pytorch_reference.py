"""PyTorch's own implementation of what the course builds, in one place: the checks compare with these.

A student who wants to see how PyTorch does it reads it here, a few lines each, on the course's MLP:

    notebook 02  data parallel      DistributedDataParallel, no_sync   train_ddp
    notebook 03  tensor parallel    DTensor, parallelize_module        tensor_parallel_plan, tensor_parallel_mlp
    notebook 04  pipeline parallel  torch.distributed.pipelining       pipeline_schedule, pipeline_step, train_pipeline
    notebook 05  ZeRO-1             ZeroRedundancyOptimizer            zero_redundancy_optimizer
    notebook 05  FSDP               FSDP2 fully_shard                  fully_shard_mlp
    notebook 06  mixed precision    FSDP2 MixedPrecisionPolicy         fully_shard_mlp_mixed_precision
    notebook 07  sharded tensors    DTensor redistribute               dtensor_redistribute
    notebook 08  checkpoints        torch.distributed.checkpoint       fsdp2_with_adamw, dcp_save, dcp_load
    notebook 09  sequence parallel  DTensor, SequenceParallel          sequence_parallel_plan, sequence_parallel_block
    notebook 11  pipeline schedules torch.distributed.pipelining       pipeline_schedule_pieces, pipeline_step_pieces
    notebook 12  FSDP x TP + SP     parallelize_module, fully_shard    fsdp_tensor_parallel_transformer, full_tensor
    notebook 12  FSDP x PP x TP     + PipelineStage, Schedule1F1B      pipeline_fsdp_tensor_parallel_transformer
    notebook 12  CP x TP (+ FSDP)   + context_parallel                 context_parallel_transformer (not on CPU)

All of them run on CPU with gloo (torch 2.13.0), on a 1-D "cpu" device mesh where they need one (notebook 12's: a
2-D (data, tensor) and a 3-D (data, pipeline, tensor) mesh), except context_parallel: its ring replaces the CUDA
attention kernels only, and on CPU scaled_dot_product_attention's kernel has no sharding strategy (NotImplementedError).
"""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from utils.model import build_mlp, detached_parameters, loss_fn, make_optimizer, step_batches, train


def train_ddp(rank, world_size, *, sizes, num_micro_batches=1, optimizer="sgd", dtype=torch.float64):
    """Notebook 02's run with DistributedDataParallel: it broadcasts rank 0's parameters when built and
    all-reduces gradients in buckets during backward; no_sync skips that for all but the last micro-batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils import data_parallel as dp

    def forward_backward(model, batch):
        chunks = batch.chunk(num_micro_batches)
        for i, micro_batch in enumerate(chunks):
            with model.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext():
                (loss_fn(model(micro_batch)) / num_micro_batches).backward()

    dp.check_sizes(sizes.batch_size, world_size, num_micro_batches)
    model = DDP(dp.build_model(sizes, sizes.seed + dp.START_SEED_STRIDE * rank, dtype))
    batches = step_batches(sizes.batch_size, sizes.hidden_dim, sizes.seed, sizes.num_steps, rank, world_size, dtype)
    train(model, make_optimizer(model.parameters(), optimizer), batches, forward_backward=forward_backward)
    return dp.state(model.module)


def tensor_parallel_plan(num_layers):
    """Notebook 03's pairing in PyTorch's words: ColwiseParallel on even layers, RowwiseParallel on odd ones."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from utils.tensor_parallel import is_column

    return {f"layers.{i}.linear": ColwiseParallel() if is_column(i) else RowwiseParallel() for i in range(num_layers)}


def tensor_parallel_mlp(world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    """The course's MLP, parallelized by DTensor's tensor parallel."""
    from torch.distributed.tensor.parallel import parallelize_module

    from utils.tensor_parallel import check_sizes

    check_sizes(hidden_dim, world_size, num_layers)
    mesh = init_device_mesh("cpu", (world_size,))
    return parallelize_module(build_mlp(hidden_dim, num_layers, seed, dtype), mesh, tensor_parallel_plan(num_layers))


def sequence_parallel_plan(prefix=""):
    """torchtitan's tensor + sequence parallel plan of one transformer block (its modules' names after `prefix`):
    the norms take this rank's chunk of the sequence (SequenceParallel; their weights' gradients come out
    Partial(sum), the all-reduce pending), attention and the MLP gather it once (PrepareModuleInput), wo and w2 leave
    by a reduce-scatter (Shard(1))."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    return {prefix + name: style for name, style in plan.items()}


def sequence_parallel_block(world_size, sizes, seed=0, dtype=torch.float64):
    """Notebook 09's transformer block with torchtitan's tensor + sequence parallel plan (sequence_parallel_plan)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from utils.sequence_parallel import check_sizes, reference_block

    check_sizes(sizes, world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    return parallelize_module(reference_block(sizes, seed, dtype), mesh, sequence_parallel_plan())


def transformer_tensor_parallel_plan(model):
    """torchtitan's tensor + sequence parallel plan of the course's transformer, or of a pipeline stage of it (the
    modules it holds): each block sequence_parallel_plan; the embedding row-parallel over the vocabulary, leaving the
    sequence sharded; the final norm SequenceParallel; the LM head column parallel, its logits gathered whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        plan.update({"norm": SequenceParallel(),
                     "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for name in model.layers:
        plan.update(sequence_parallel_plan(f"layers.{name}."))
    return plan


def tensor_parallel_fully_shard(model, tensor_mesh, data_mesh):
    """torchtitan's order: parallelize_module on the tensor mesh (transformer_tensor_parallel_plan), then fully_shard
    of each block and of the root on the data mesh. Its parameters become DTensors on the 2-D mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tensor_mesh, transformer_tensor_parallel_plan(model))
    if model.output is not None:
        model.output.register_forward_hook(lambda module, inputs, logits: logits.clone())  # FSDP2 warns of a view
    for block in model.layers.values():
        fully_shard(block, mesh=data_mesh)
    return fully_shard(model, mesh=data_mesh)


def fsdp_tensor_parallel_transformer(data_parallel, tensor_parallel, sizes, seed=0, dtype=torch.float64):
    """The course's transformer as torchtitan composes FSDP and tensor parallel (notebook 12):
    tensor_parallel_fully_shard on a (data, tensor) mesh. Takes each data rank's whole token sequence; every tensor
    rank returns the same logits. Returns (model, mesh)."""
    from utils.transformer import build_transformer

    mesh = init_device_mesh("cpu", (data_parallel, tensor_parallel), mesh_dim_names=("data", "tensor"))
    return tensor_parallel_fully_shard(build_transformer(sizes, seed, dtype), mesh["tensor"], mesh["data"]), mesh


def transformer_stage(sizes, stage, num_stages, seed=0, dtype=torch.float64):
    """Pipeline stage `stage` of the course's transformer: its layers (utils.pipeline.stage_layers), the embedding
    on the first stage, the final norm and the LM head on the last; every forward at the whole sequence's positions
    (a later stage receives hidden states, whose length under sequence parallel is this rank's chunk's)."""
    from utils.pipeline import stage_layers
    from utils.transformer import build_transformer

    model = build_transformer(sizes, seed, dtype)
    keep = {str(i) for i in stage_layers(sizes.num_layers, num_stages)[stage]}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < num_stages - 1:
        model.norm = model.output = None
    model.register_forward_pre_hook(lambda module, args, kwargs: (args, {"positions": torch.arange(sizes.seq_len)}),
                                    with_kwargs=True)
    return model


def pipeline_fsdp_tensor_parallel_transformer(mesh_shape, num_micro_batches, sizes, seed=0, dtype=torch.float64):
    """torchtitan's 3-D composition (notebook 12) on a (data, pipeline, tensor) mesh: this rank's transformer_stage,
    tensor_parallel_fully_shard on mesh["tensor"] and mesh["data"], then PipelineStage on mesh["pipeline"]'s group
    and Schedule1F1B over the micro-batches (each micro-batch's loss lm_loss, the gradients scaled by 1/m: the
    batch's mean). What crosses from stage to stage is a plain tensor, this tensor rank's chunk of the sequence (the
    blocks' plans take and return local tensors). Returns (model, schedule, mesh)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from utils.transformer import lm_loss

    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("data", "pipeline", "tensor"))
    stage, num_stages = mesh["pipeline"].get_local_rank(), mesh_shape[1]
    model = tensor_parallel_fully_shard(transformer_stage(sizes, stage, num_stages, seed, dtype), mesh["tensor"],
                                        mesh["data"])
    pipeline_stage = PipelineStage(model, stage, num_stages, torch.device("cpu"), group=mesh["pipeline"].get_group())
    return model, Schedule1F1B(pipeline_stage, num_micro_batches, loss_fn=lm_loss, scale_grads=True), mesh


def causal_sdpa(q, k, v, positions):
    """Attention as scaled_dot_product_attention computes it, causal (the call context_parallel replaces by its ring,
    which masks by its own sharding of the sequence: `positions` unused)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def context_parallel_transformer(mesh_shape, sizes, seed=0, dtype=torch.float64):
    """torchtitan's composition of context and tensor parallel on a (context, tensor) mesh: every block's attention
    through scaled_dot_product_attention (causal_sdpa), then tensor_parallel_fully_shard on mesh["tensor"] and
    mesh["context"] (FSDP over the context dimension: torchtitan shards over dp_shard x cp). Its forward and
    backward run inside context_parallel(mesh["context"], buffers=[tokens, targets, positions]), which shards
    them along the sequence and runs scaled_dot_product_attention as a ring. Returns (model, mesh)."""
    from utils.context_parallel import use_attention
    from utils.transformer import build_transformer

    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("context", "tensor"))
    model = use_attention(build_transformer(sizes, seed, dtype), causal_sdpa)
    return tensor_parallel_fully_shard(model, mesh["tensor"], mesh["context"]), mesh


def pipeline_schedule(rank, world_size, schedule_name, hidden_dim, num_layers, num_micro_batches, seed=0,
                      dtype=torch.float64):
    """(this stage's module, PyTorch's schedule) with PipelineStage and ScheduleGPipe or Schedule1F1B.

    PyTorch's schedules compute the loss of each micro-batch (a mean over its rows) and, with
    scale_grads=True (the default), divide the gradients by the number of micro-batches at the end:
    the full batch's gradients, as ours.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from utils import pipeline as pp

    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule_name not in schedules:
        raise ValueError(f"schedule must be one of {list(schedules)}, got {schedule_name!r}")
    module = pp.Stage(rank, world_size, hidden_dim, num_layers, seed, dtype)
    stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
    return module, schedules[schedule_name](stage, num_micro_batches, loss_fn=lambda output, target: loss_fn(output),
                                            scale_grads=True)


def pipeline_step(module, schedule, batch):
    """One step's forwards and backwards; returns the batch's loss on the last stage (None elsewhere)."""
    if module.is_first:
        schedule.step(batch)
        return None
    losses = []
    target = torch.zeros(len(batch)) if module.is_last else None  # the loss ignores it
    schedule.step(target=target, losses=losses)
    return sum(loss.detach() for loss in losses) / len(losses) if module.is_last else None


def pipeline_schedule_pieces(rank, world_size, schedule_name, num_virtual, hidden_dim, num_layers, num_micro_batches,
                             seed=0, dtype=torch.float64):
    """(this rank's pieces, an nn.ModuleList; PyTorch's schedule) for the schedules with several pieces per rank:
    "interleaved-1f1b" (ScheduleInterleaved1F1B) and "interleaved-zb" (ScheduleInterleavedZeroBubble) on
    pieces rank, rank + p, ...; "zbv" (ScheduleZBVZeroBubble, 2 pieces) on pieces rank and 2p - 1 - rank."""
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from utils import pipeline as pp

    schedules = {"interleaved-1f1b": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
                 "zbv": ScheduleZBVZeroBubble}
    if schedule_name not in schedules:
        raise ValueError(f"schedule must be one of {list(schedules)}, got {schedule_name!r}")
    n = world_size * num_virtual
    pieces = ([rank, n - 1 - rank] if schedule_name == "zbv"
              else [rank + k * world_size for k in range(num_virtual)])
    modules = torch.nn.ModuleList(pp.Stage(i, n, hidden_dim, num_layers, seed, dtype) for i in pieces)
    stages = [PipelineStage(module, i, n, torch.device("cpu")) for module, i in zip(modules, pieces)]
    return modules, schedules[schedule_name](stages, num_micro_batches,
                                             loss_fn=lambda output, target: loss_fn(output), scale_grads=True)


def pipeline_step_pieces(modules, schedule, batch):
    """One step of a schedule with several pieces per rank; the batch's loss where the last piece is, else None."""
    first, last = any(m.is_first for m in modules), any(m.is_last for m in modules)
    losses = []
    target = torch.zeros(len(batch))  # the loss ignores it
    schedule.step(*([batch] if first else []), target=target, losses=losses)
    return sum(loss.detach() for loss in losses) / len(losses) if last else None


def train_pipeline(rank, world_size, schedule_name, *, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches=1, optimizer="sgd", seed=0, dtype=torch.float64):
    """Notebook 04's training run with PyTorch's schedule: a utils.pipeline.PytorchRun."""
    from utils import pipeline as pp

    pp.check_sizes(num_layers, world_size, batch_size, num_micro_batches)
    module, schedule = pipeline_schedule(rank, world_size, schedule_name, hidden_dim, num_layers, num_micro_batches,
                                         seed, dtype)
    losses = train(module, make_optimizer(module.parameters(), optimizer),
                   step_batches(batch_size, hidden_dim, seed, num_steps, dtype=dtype),
                   forward_backward=lambda module, batch: pipeline_step(module, schedule, batch))
    return pp.PytorchRun(detached_parameters(module), losses, schedule_name)


def zero_redundancy_optimizer(params, optimizer_class=torch.optim.AdamW, **defaults):
    """ZeRO-1 as PyTorch has it: each rank steps the optimizer for its share of the whole parameters, then
    broadcasts them; its step expects gradients already averaged, so this one all-reduces them first."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class AveragingZero(ZeroRedundancyOptimizer):
        def step(self, closure=None):
            for p in self._all_params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            return super().step(closure)

    return AveragingZero(params, optimizer_class, **defaults)


def fully_shard_mlp(world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    """The course's MLP under FSDP2: fully_shard on each layer (a unit), then on the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_mlp(hidden_dim, num_layers, seed, dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fully_shard_mlp_mixed_precision(world_size, hidden_dim, num_layers, seed=0, param_dtype=torch.bfloat16,
                                    reduce_dtype=torch.float32):
    """The course's MLP under FSDP2 with a MixedPrecisionPolicy. The sharded parameters stay fp32 (the
    optimizer's master weights); each unit is cast to `param_dtype` before its all-gather and computes in it
    (its inputs too); its gradient is cast to `reduce_dtype` before the reduce-scatter."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = build_mlp(hidden_dim, num_layers, seed, torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def full_tensor(p):
    """A DTensor's whole value, gathered one mesh dimension at a time (in one go, DTensor warns that it needs two
    all-gathers on a 2-D mesh)."""
    from torch.distributed.tensor import Replicate

    placements = list(p.placements)
    for i in range(len(placements)):
        placements[i] = Replicate()
        p = p.redistribute(placements=placements)
    return p.to_local()


def dtensor_redistribute(local, src, dst, shape, mesh=None):
    """DTensor's own redistribute: this rank's `local` tensor of a DTensor of global `shape` with placement `src`
    on the 1-D mesh of all ranks, moved to placement `dst`; returns the new local tensor."""
    from torch.distributed.tensor import DTensor

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    stride = torch.empty(shape, device="meta").stride()
    dtensor = DTensor.from_local(local, mesh, [src], run_check=False, shape=torch.Size(shape), stride=stride)
    return dtensor.redistribute(mesh, [dst]).to_local()


def fsdp2_with_adamw(world_size, hidden_dim, num_layers, seed=0, full_state=None, dtype=torch.float64):
    """The course's MLP under FSDP2 with AdamW; given `full_state` (every rank: {"model": {name: tensor},
    "optim": {"state": {name: {"step", "exp_avg", "exp_avg_sq"}}}}), set_state_dict shards it into them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model = fully_shard_mlp(world_size, hidden_dim, num_layers, seed, dtype)
    optimizer = make_optimizer(model.parameters(), "adamw")  # the course's AdamW (utils.fsdp.ADAMW's settings)
    if full_state is not None:
        optim_state = {"state": full_state["optim"]["state"], "param_groups": optimizer.state_dict()["param_groups"]}
        for group in optim_state["param_groups"]:  # state dicts name parameters by their fully qualified names
            group["params"] = list(full_state["model"])
        set_state_dict(model, optimizer, model_state_dict=full_state["model"], optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=True))
    return model, optimizer


def dcp_save(directory, model, optimizer):
    """torch.distributed.checkpoint's save: get_state_dict gives the sharded state dicts (DTensors), dcp.save
    writes each rank's shards and the metadata (.metadata) that lets any number of ranks load them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)


def dcp_load(directory, model, optimizer, full=True):
    """dcp.load into an FSDP2 model and its AdamW on any number of ranks (DCP reshards), then set_state_dict;
    returns the full state, as fsdp2_with_adamw takes it (with `full`: it all-gathers every tensor)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)  # what to load into (AdamW's state made)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if not full:
        return None
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": model_state, "optim": {"state": optim_state["state"]}}
