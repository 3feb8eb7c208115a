"""Bring up torch.distributed and megatron-core's parallel state for one training run."""

import datetime
import os

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fork import device as compute_device
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def initialize_distributed(tp: int, pp: int, vpp: int | None, seed: int, timeout_minutes: int = 10) -> None:
    """NCCL on GPUs, gloo on CPU; works under torchrun or as a single plain process."""
    if not dist.is_initialized():
        if compute_device.cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" not in os.environ:  # plain `python pretrain_gpt_mtp.py`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group(
            compute_device.distributed_backend(), timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    initialize_model_parallel(tp, pp, vpp, seed)


def initialize_model_parallel(tp: int, pp: int, vpp: int | None, seed: int, ep: int = 1) -> None:
    """TP x PP (x VPP) groups, data parallel over the rest of the world (expert parallel EP
    over it for MoE layers), and seeded RNG trackers."""
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel size"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
    )
    model_parallel_cuda_manual_seed(seed)
