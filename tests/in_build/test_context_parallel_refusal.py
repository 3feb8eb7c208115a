# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MTP with context parallelism (spec section 10): built where the series rolls depth-k targets
across context-parallel ranks exactly (0.19.2: tests/test_context_parallel.py proves it),
refused before any state changes where it does not (0.16.1), naming the fix; split steps take
CP chunks (their forward step cuts the micro-batches; the layouts are tested in
tests/test_normalization.py and tests/test_mtp_layouts.py)."""

import os

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.mtp.step import SplitStep

EXACT_ROLL = os.environ["MEGATRON_MTP_BUILD"] == "0.19.2"


def config(**kwargs) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, calculate_per_token_loss=True,
                             **kwargs)


def test_mtp_with_context_parallelism_is_built_only_where_the_roll_is_exact():
    if EXACT_ROLL:
        config(mtp_num_layers=2, context_parallel_size=2)
    else:
        with pytest.raises(ValueError, match=r"context parallelism \(context_parallel_size=2\) needs megatron-core "
                                             r"0\.19\.2's series.*--context-parallel-size 1"):
            config(mtp_num_layers=2, context_parallel_size=2)
    config(context_parallel_size=2)  # without MTP the model itself is upstream's business


def test_a_split_step_takes_context_parallel_chunks():
    chunk = type("Chunk", (), {"config": config(context_parallel_size=2)})()
    step = SplitStep([chunk], optimizer=None, forward_step_func=None, seq_length=8, micro_batch_size=1)
    assert not step.in_progress
