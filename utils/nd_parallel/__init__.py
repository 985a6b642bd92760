"""Parallelisms composed on one mesh (notebook 12), one file per concern; the notebook reads them all as `nd.X`:

    mesh.py           section 1: the mesh, its layout and groups, and the picture of who talks to whom
    fsdp_tensor.py    section 2: FSDP x tensor (and sequence) parallel on a (data, tensor) mesh, the runs that train it
                      (ours, PyTorch's) and the loop the compositions share
    pipeline_3d.py    section 3: pipeline stages on a (data, pipeline, tensor) mesh, each stage section 2's composition
                      (ours, and PyTorch's run: PipelineStage and Schedule1F1B)
    context.py        section 4: ring attention on a (context, tensor) mesh, composed with section 2's
                      (ours, and PyTorch's context_parallel run, which fails on CPU)
    communication.py  every call recorded per group, and what the guards refuse before a call can hang the ranks
"""
from utils.nd_parallel.communication import (
    CompositionMistake,
    bytes_per_group,
    calls_per_group,
    communication_by_group,
)
from utils.nd_parallel.context import (
    MESH_CP,
    RunCP,
    check_sizes_cp,
    cp_tokens,
    formula_calls_cp,
    train_cp_main,
    train_pytorch_cp_main,
)
from utils.nd_parallel.fsdp_tensor import (
    FlatShards,
    Run2D,
    agreement,
    check_sizes_2d,
    formula_memory_2d,
    full_weights,
    global_losses,
    local_numels,
    loss_share,
    measure_2d,
    my_tokens,
    sharded_over_tensor,
    slowest_steps,
    tensor_sequence_parallel,
    tensor_shard,
    train_2d_main,
    train_pytorch_2d_main,
)
from utils.nd_parallel.mesh import (
    MESH_2D,
    MESH_3D,
    check_mesh,
    default_mesh,
    device_mesh_groups,
    device_mesh_layout,
    mesh_groups,
    mesh_picture,
)
from utils.nd_parallel.pipeline_3d import (
    Run3D,
    check_sizes_3d,
    formula_calls_3d,
    full_weights_3d,
    hidden_like,
    journal_message,
    pipeline_neighbours,
    stage_forward,
    stage_names,
    train_3d_main,
    train_pytorch_3d_main,
    unpaired_messages,
)
