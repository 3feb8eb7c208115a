# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_gpu.py."""

import importlib.util

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mtp.library.batches import BYTE_VOCAB_SIZE, embedded_corpus, global_batch, rank_microbatches
from megatron_mtp.library.model import build_model
from megatron_mtp.library.step import train_step
from tests.harness.layout import model_parallel


def _steps(use_transformer_engine: bool) -> list[dict]:
    with model_parallel(seed=5):
        config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, mtp_num_layers=1,
                                   hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                                   params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                                   calculate_per_token_loss=True)
        chunks = build_model(config, BYTE_VOCAB_SIZE, 64, use_transformer_engine=use_transformer_engine)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16), chunks)
        corpus = embedded_corpus()
        out = []
        for step in range(3):
            tokens, mask = global_batch(corpus, 8, 64, seed=5, step=step)
            out.append(train_step(chunks, optimizer, rank_microbatches(tokens, mask, 4), 64))
        return out


def bf16_steps() -> dict:
    from megatron.core.fork import device as compute_device

    has_te = importlib.util.find_spec("transformer_engine") is not None
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        # upstream's torch.cuda.current_device(): the index, an int
        "current_device": [type(compute_device.current_device()).__name__, compute_device.current_device()
                           == torch.cuda.current_device()],
        "local": _steps(False),
        "transformer_engine": _steps(True) if has_te else None,
    }
