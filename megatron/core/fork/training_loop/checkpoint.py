# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What megatron.training's checkpoints carry for MTP training, and how it is checked
(spec section 9).

``state`` goes into every checkpoint beside upstream's entries: the model's shape
(megatron.core.fork.training_loop.model_shape) and the metric counters that span steps. On load,
``check`` refuses a checkpoint of another shape before any tensor is read, naming each
difference (with --finetune the MTP depths may differ: heads can be added to, or dropped
from, a pretrained backbone), and ``restore`` continues the counters. The files themselves
are committed and verified by megatron.core.fork.upstream_fixes.checkpoint_files.
"""

import os

from megatron.core.fork.training_loop import metrics
from megatron.core.fork.training_loop.model_shape import check_same_shape, model_shape
from megatron.core.fork.upstream_fixes.checkpoint_files import CheckpointError, read, verify

KEY = "mtp_training"


def state(model) -> dict:
    return {"model_shape": model_shape(model[0]), "metrics": metrics.state_dict()}


def check(common_state: dict, model, finetune: bool) -> None:
    """Raise CheckpointError if the checkpoint's model shape differs from `model`'s."""
    check_shape((common_state or {}).get(KEY), model_shape(model[0]), finetune)


def check_shape(saved: dict | None, current: dict, finetune: bool) -> None:
    """Raise CheckpointError if the shape in this trainer's entry `saved` (None: a checkpoint
    not written by this trainer, which upstream's own argument checks cover) differs from
    `current` (a ``model_shape``)."""
    if saved is None:
        return
    try:
        check_same_shape(saved["model_shape"], current, finetune)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def restore(common_state: dict) -> None:
    metrics.load_state_dict(((common_state or {}).get(KEY) or {}).get("metrics"))


def saved_entry(load_dir: str, step: int | None = None) -> dict | None:
    """This trainer's entry (model shape, counters) in the checkpoint a run would resume from;
    None when there is nothing to resume or the checkpoint was not written by this trainer.
    Reads the common state only, no tensor."""
    directory = verify(load_dir, step)
    if directory is None or not os.path.isfile(os.path.join(directory, "metadata.json")):
        return None
    from megatron.core.dist_checkpointing import load_common_state_dict

    return (read(directory, load_common_state_dict) or {}).get(KEY)


