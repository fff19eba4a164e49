"""Tensor parallelism for the Llama-family engine, over torch.distributed (NCCL on GPUs, gloo on the CPU).

    state.py      this process's TP group: rank, size, the device and control process groups
    shard.py      Megatron-style slices of the full HF-named weights, per rank
    processes.py  spawning ranks as processes (launch: all of them; spawn_followers: ranks 1..N-1)
    tp_engine.py  the SPMD lockstep driver: rank 0's LockstepEngine, the followers' follow() loop
    lockstep_cache.py  each rank's radix cache, stamped by rank 0's broadcast clock

The model's hooks are in model/llama.py and model/fused.py (per-rank head counts, an all_reduce after
o_proj and down_proj); the Engine joins a group only when EngineConfig.tensor_parallel_size > 1.
"""
from services.gpu_worker.parallel.processes import launch, spawn_followers
from services.gpu_worker.parallel.shard import check_tensor_parallel, shard_state_dict
from services.gpu_worker.parallel.state import (TensorParallelGroup, current_group, destroy_tensor_parallel,
                                                init_tensor_parallel)
from services.gpu_worker.parallel.tp_engine import LockstepEngine, TensorParallelDivergence, follow, start_engine

__all__ = ["LockstepEngine", "TensorParallelDivergence", "TensorParallelGroup", "check_tensor_parallel",
           "current_group", "destroy_tensor_parallel", "follow", "init_tensor_parallel", "launch",
           "shard_state_dict", "spawn_followers", "start_engine"]
