# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MTP on the first pipeline rank is refused when the config is built (issue 16).

Upstream's layout check means to keep MTP off the first pipeline rank but skips that rank's
last virtual stage; with MTP there ("Et|t|t*2mm|L", PP = 2 x VPP = 2) the rank holds two
word-embedding copies and finalize_model_grads reduced only one (tests/test_mtp_layouts.py
measured relative gradient errors 0.048 and 1.05; tied, the build hung).
"""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig


def config(layout: str) -> TransformerConfig:
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, mtp_num_layers=2,
                             pipeline_model_parallel_size=2, pipeline_model_parallel_layout=layout,
                             pipeline_dtype=torch.float32)


def test_mtp_on_the_first_pipeline_rank_is_refused_naming_the_way_out():
    with pytest.raises(ValueError) as refused:
        config("Et|t|t*2mm|L")
    message = str(refused.value)
    assert "first pipeline rank's last virtual stage" in message and "(...|mmL)" in message, message


@pytest.mark.parametrize("layout", ["Et|t|t*2|mmL", "Et*4|mmL", "Et*2|t*2mmL"])
def test_mtp_on_another_rank_is_accepted(layout):
    config(layout)


def test_the_library_asks_whether_embeddings_are_tied_for_an_mtp_stage_before_the_loss():
    """An MTP stage before the loss stage holds an embedding copy; the loss stage's output
    weight is one more only when tied: the library's word-embedding group cannot guess."""
    from megatron_mtp.library.initialize import initialize_model_parallel

    with pytest.raises(ValueError, match=r"before the loss stage: say whether .*tied_embeddings="):
        initialize_model_parallel(1, 4, None, 1234, pipeline_layout="Et*2|t*2|mm|L")
    with pytest.raises(ValueError, match="contradicts the layout"):
        initialize_model_parallel(1, 2, 3, 1234, pipeline_layout="Et|t|t|mmL")
