# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bring up torch.distributed and megatron-core's parallel state for one training run."""

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron.core.fork.runtime import device as compute_device


def initialize_distributed(tp: int, pp: int, vpp: int | None, seed: int, timeout_minutes: int = 10,
                           cp: int = 1) -> None:
    """NCCL on GPUs, gloo on CPU; works under torchrun or as a single plain process. `cp`: the
    context-parallel size (`initialize_model_parallel`)."""
    if not dist.is_initialized():
        if compute_device.cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" not in os.environ:  # plain `python pretrain_gpt_mtp.py`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group(
            compute_device.distributed_backend(), timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    initialize_model_parallel(tp, pp, vpp, seed, cp=cp)


def embedding_ranks(pp_ranks: list[int], tied: bool, mtp_config) -> list[int]:
    """The word-embedding group of one pipeline (as Megatron-LM's pretrain_gpt.py): the first
    stage, the last when embeddings and output weights are tied, and every stage with MTP
    layers (each holds a copy of the embedding). `mtp_config` carries `mtp_num_layers` and
    the parsed `pipeline_model_parallel_layout` (a TransformerConfig does)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1:
        if tied:
            ranks.append(pp_ranks[-1])
        ranks.extend(get_mtp_ranks(pp_ranks, mtp_config))
    return sorted(set(ranks))


def initialize_model_parallel(tp: int, pp: int, vpp: int | None, seed: int, ep: int = 1, *,
                              pipeline_layout: str | None = None, tied_embeddings: bool | None = None,
                              cp: int = 1) -> None:
    """TP x CP x PP (x VPP) groups, data parallel over the rest of the world (expert parallel EP
    over it for MoE layers), and seeded RNG trackers. Context parallelism (CP) cuts every
    sequence over `cp` ranks. `pipeline_layout` is upstream's
    (e.g. "Et*2|m|L"; its virtual stages are the ones used when `vpp` is None). The
    word-embedding group is the model's (`embedding_ranks`): a layout with MTP layers before
    the loss stage needs `tied_embeddings` (tied, the loss stage's output weight is one more
    copy; untied, it must stay out); otherwise the first and last stage serve tied and
    untied models alike."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    mtp_config = SimpleNamespace(mtp_num_layers=None, pipeline_model_parallel_layout=None)
    if pipeline_layout is not None:
        parsed = PipelineParallelLayerLayout(pipeline_layout, pp)
        layout_vpp = parsed.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp != layout_vpp:
            raise ValueError(f"virtual pipeline size {vpp} contradicts the layout {pipeline_layout!r} ({layout_vpp})")
        vpp = layout_vpp if layout_vpp > 1 else None
        depths = sum(stage.count(LayerType.mtp) for stages in parsed.layout for stage in stages)
        mtp_config = SimpleNamespace(mtp_num_layers=depths, pipeline_model_parallel_layout=parsed)
        if tied_embeddings is None and set(get_mtp_ranks(list(range(pp)), mtp_config)) - {pp - 1}:
            raise ValueError(f"the layout {pipeline_layout!r} puts MTP layers before the loss stage: "
                             "say whether embeddings and output weights are tied (tied_embeddings=)")
    tied = True if tied_embeddings is None else tied_embeddings
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel size"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        get_embedding_ranks=lambda pp_ranks, *_: embedding_ranks(pp_ranks, tied, mtp_config),
    )
    model_parallel_cuda_manual_seed(seed)
