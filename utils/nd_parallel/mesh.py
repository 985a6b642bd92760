"""The mesh (notebook 12, section 1). W ranks laid out as a tensor of shape (data, pipeline, tensor), row-major as
`init_device_mesh` lays them out: rank = ((d * P) + p) * T + t. A rank belongs to one group per dimension: the ranks
that differ from it in that coordinate only. Each parallelism runs its collectives on its own dimension's group:

    data      FSDP: all-gather of the parameters' shards, reduce-scatter of the gradients
    pipeline  send / recv of activations forward, of their gradients backward, between neighbouring stages
    tensor    TP + SP: all-gather and reduce-scatter along the sequence around each column/row pair,
              all-reduce of the gradients of the weights every tensor rank holds whole
"""
import math

import torch
import torch.distributed as dist

from utils.sizes import check_int

MESH_3D = ("data", "pipeline", "tensor")
MESH_2D = ("data", "tensor")
COLLECTIVES_ON = {"data": "FSDP: all-gather of the parameters' shards, reduce-scatter of the gradients",
                  "pipeline": "send/recv: activations forward, their gradients backward, stage to stage",
                  "tensor": "TP/SP: all-gather and reduce-scatter along the sequence around each column/row pair; "
                            "all-reduce of the whole weights' gradients"}


def check_mesh(shape, world_size, names=None):
    """The mesh's sizes, as a tuple of ints, when they multiply to the world size; else a ValueError naming them."""
    shape = tuple(check_int("mesh size", s) for s in shape)
    names = names or tuple(f"dim {i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise ValueError(f"mesh shape {shape} has {len(shape)} dimensions, its names {names} {len(names)}")
    if math.prod(shape) != check_int("world_size", world_size):
        sizes = " x ".join(f"{n} {s}" for n, s in zip(names, shape))
        raise ValueError(f"mesh {sizes} = {math.prod(shape)} ranks, but the world has {world_size}: the mesh's "
                         f"sizes must multiply to the world size")
    return shape


def default_mesh(world_size, names=MESH_3D):
    """A mesh of `world_size` ranks: 2 for each dimension from the last (tensor) while 2 divides what is left, the
    rest on the first (data). 8 ranks: (2, 2, 2); 4: (1, 2, 2) in 3-D, (2, 2) in 2-D; 2: the tensor dimension."""
    left, sizes = check_int("world_size", world_size), []
    for _ in names[1:]:
        size = 2 if left % 2 == 0 else 1
        sizes.append(size)
        left //= size
    return (left, *reversed(sizes))


def device_mesh_layout(shape):
    """What DeviceMesh computes, on one process: (coordinates by rank, groups by dimension, each a list of rank
    lists). Its layout is torch.arange(W).view(shape); the groups of dimension i are the lines along i."""
    mesh = torch.arange(math.prod(shape)).view(shape)
    coordinates = {int(r): tuple(int(c) for c in torch.nonzero(mesh == r)[0]) for r in mesh.flatten()}
    groups = [mesh.movedim(i, -1).reshape(-1, size).tolist() for i, size in enumerate(shape)]
    return coordinates, groups


def device_mesh_groups(shape, names):
    """On a rank: (its coordinate, the ranks of each of its groups) as init_device_mesh builds them."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return tuple(mesh.get_coordinate()), [dist.get_process_group_ranks(mesh.get_group(n)) for n in names]


def mesh_picture(shape, names, mesh_position):
    """Text: the ranks laid out on the mesh (2 or more dimensions: a grid of the last two per value of the others),
    then each dimension's groups and what runs on them; everything from mesh_position(rank, shape)."""
    position = {rank: mesh_position(rank, shape) for rank in range(math.prod(shape))}
    grids = {}  # the other coordinates -> row -> the row's ranks, in column order
    for rank, (coordinate, _) in sorted(position.items(), key=lambda item: tuple(item[1][0])):
        *others, row, _ = coordinate
        grids.setdefault(tuple(others), {}).setdefault(row, []).append(rank)
    lines = []
    for others, rows in grids.items():
        lines.append(", ".join(f"{n} {c}" for n, c in zip(names, others)) + f":   {names[-1]} ->")
        lines += [f"{f'  {names[-2]} {row}':>12}  " + " ".join(f"{r:>2}" for r in ranks) for row, ranks in rows.items()]
    for i, name in enumerate(names):
        groups = sorted({tuple(groups[i]) for _, groups in position.values()})
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups)
        lines.append(f"{name:>9} groups {shown:<28} {COLLECTIVES_ON.get(name, '')}")
    return "\n".join(lines)


def mesh_groups(shape, names=MESH_2D):
    """On a rank: the mesh's groups by name ({"data": ..., "tensor": ...} in 2-D) and this rank's coordinate."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return {name: mesh.get_group(name) for name in names}, tuple(mesh.get_coordinate())
