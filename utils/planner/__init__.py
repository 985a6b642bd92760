"""The planner (notebook 12, section 5): memory per device and time per step of every way to split a training run.

    model + cluster + global batch -> for each (dp, tp, pp, cp, ep, micro-batch size, recompute, ZeRO stage,
    pipeline schedule):
        memory per device = parameters + gradients + optimizer states + activations + logits + buffers
                            + fragmentation + runtime, on the pipeline stage that needs the most   (memory.py)
        step time         = each layer's matrix products through the device's roofline           (compute.py)
                            + the communication they do not hide, layer by layer                   (step.py)
                            + the pipeline's bubble by schedule + the optimizer
    -> the configurations that fit in memory, fastest first                                        (search.py)

One module per concern: describe (the model, devices, a split and its refusals), memory, compute, communication
(the primitives a replay of recorded steps uses: matmul_seconds, message_seconds, collective_seconds), step,
search, and course (the bytes of the course's small model on gloo). Every formula is the course's (its notebook
named where it is used) or a paper's, named; every constant of a device has its source in describe.py.

An estimate, not a simulator: the overlaps are decided by a rule per layer, not measured; the efficiency curve is
stated, not fitted to a profile.
"""
from utils.planner.communication import (BACKENDS, collective_bytes, collective_seconds, group_link, group_links,
                                         message_seconds)
from utils.planner.compute import LayerTimes, layer_times, matmul_seconds, memory_bound_seconds, output_layer_seconds
from utils.planner.course import (expert_dispatch_bytes_per_token, fsdp_bytes, fsdp_unit_bytes, ring_attention_bytes,
                                  small_model_bytes, small_model_units, tensor_parallel_layer_bytes)
from utils.planner.describe import (A100_80GB, CP_MODES, GB, GPU, GPUS, H100_SXM, RECOMPUTE, RECOMPUTE_OTHER,
                                    SCHEDULES, ZERO_STAGES, Cluster, Config, Link, Model, check_config, cluster,
                                    rank_dense_layers, rank_layer_counts, rank_layer_kinds,
                                    stage_layer_counts)
from utils.planner.memory import (BUCKET_ELEMENTS, FRAGMENTATION, LOSS_PARALLEL_BYTES, RUNTIME_BYTES, activation_bytes, buffer_bytes,
                                  embedding_dropout_bytes,
                                  layer_activation_bytes, logits_bytes, memory_per_device, micro_batches_in_flight,
                                  model_state_bytes, peak_memory, pieces_in_flight, rank_layers, stage_output_bytes,
                                  stage_params,
                                  zero_sharded_bytes)
from utils.planner.search import (COLUMNS, SCHEDULE_CHOICES, configs, divisors, estimate, estimates, format_rows,
                                  plan)
from utils.planner.step import bubble_seconds, root_unit_seconds, step_seconds
