"""Context parallelism is refused before any state changes, naming what is unsupported
(spec section 10): MTP with CP when the config is built, and any split step under CP."""

import pytest

from megatron.core.fork.split_step import SplitStep
from megatron.core.transformer.transformer_config import TransformerConfig


def config(**kwargs) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, calculate_per_token_loss=True,
                             **kwargs)


def test_mtp_with_context_parallelism_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"context parallelism \(context_parallel_size=2\).*--context-parallel-size 1"):
        config(mtp_num_layers=2, context_parallel_size=2)
    config(context_parallel_size=2)  # without MTP the model itself is upstream's business


def test_a_split_step_under_context_parallelism_is_refused():
    chunk = type("Chunk", (), {"config": config(context_parallel_size=2)})()
    with pytest.raises(ValueError, match=r"split steps do not support context parallelism \(context_parallel_size=2\)"):
        SplitStep([chunk], optimizer=None, forward_step_func=None, seq_length=8, micro_batch_size=1)
