# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Save and load model (and optimizer) state with megatron-core dist checkpointing.

A checkpoint is written into a temporary sibling directory and renamed into place
only when complete, so an interrupted save never leaves a half-written checkpoint
under the final name. It records the model's shape (megatron.core.fork.training_loop.model_shape),
and loading into a model of another shape is refused, naming each difference, before
any tensor is read.
"""

import os
import shutil
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from megatron.core.fork.mtp.forward_settings import innermost, step_of
from megatron.core.fork.training_loop.model_shape import check_same_shape, model_shape

MODEL_SHAPE_KEY = "model_shape"


def model_state(chunks) -> dict:
    # Megatron-LM's trainer passes the same metadata; GPTModel needs it when MTP sits on a
    # pipeline stage without the embedding.
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return {f"model{i}": chunk.module.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(chunks)}


def save_checkpoint(path, chunks, optimizer=None) -> None:
    if any(step_of(innermost(chunk)) is not None for chunk in chunks):
        raise RuntimeError(
            "a training step is in progress (begin() without finish()/abort()); its gradients and "
            "loss scaling are not part of a checkpoint. Finish or abort the step, then save."
        )
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = model_state(chunks)
    state[MODEL_SHAPE_KEY] = model_shape(chunks[0].module)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state)
    dist_checkpointing.save(state, str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        if path.exists():
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(partial, path)
            shutil.rmtree(old)
        else:
            os.rename(partial, path)
    dist.barrier()


def load_checkpoint(path, chunks, optimizer=None) -> None:
    if not Path(path).is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    check_same_shape(dist_checkpointing.load_common_state_dict(str(path))[MODEL_SHAPE_KEY],
                     model_shape(chunks[0].module))
    state = model_state(chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    for i, chunk in enumerate(chunks):
        # a virtual stage the layout leaves empty has nothing saved, so dist checkpointing
        # returns no entry for it
        chunk.module.load_state_dict(loaded.get(f"model{i}", {}))
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
