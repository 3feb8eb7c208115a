# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_gpu.py."""

import importlib.util

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mtp.library.batches import rank_microbatches
from megatron_mtp.library.model import build_model
from megatron_mtp.library.step import train_step
from tests.harness.corpora import BYTE_VOCAB_SIZE, embedded_corpus, global_batch
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
    from megatron.core.fork.runtime import device as compute_device

    has_te = importlib.util.find_spec("transformer_engine") is not None
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        # upstream's torch.cuda.current_device(): the index, an int
        "current_device": [type(compute_device.current_device()).__name__, compute_device.current_device()
                           == torch.cuda.current_device()],
        "local": _steps(False),
        "transformer_engine": _steps(True) if has_te else None,
    }


def packed_delta_net(dtype: str = "bfloat16") -> dict:
    """Qwen3-Next's layers "G-*-" (the kernels' path; MTP is the CPU tests') in `dtype` on a packed
    row (sequences of 5, 1, 67 and 3 tokens) through upstream's path: on a GPU,
    flash-linear-attention's kernels with cu_seqlens (elsewhere the fork's: float32 1.8e-7, bf16
    4.1e-3 on CPU). Its logits against the float32 reference's recurrent DeltaNet within the packed
    segments on the same (bf16-rounded) weights, beside how far the reference moves when the
    sequences are not separated (one segment for the whole row; 0.24): the error must be a small
    part of that, or the kernels would not be resetting at the boundaries."""
    import dataclasses

    from megatron.core.fork.runtime import device as compute_device
    from tests.bodies.context_parallel import packed_row
    from tests.bodies.hybrid import DELTA_NET_PACKED, delta_net_model, delta_net_reference
    from tests.bodies.mtp_model import Capture, packed_params

    device = compute_device.current_device()
    with model_parallel():
        dtype = getattr(torch, dtype)
        model = delta_net_model(0, False, False, "hybrid", bf16=dtype == torch.bfloat16, params_dtype=dtype)
        model = model.to(device=device, dtype=dtype)
        ref, _ = delta_net_reference(model, 0, False)  # (float32 parameters holding the bf16 values)
        ref = ref.float().cpu()
        (input_ids, labels, mask, segments), _, _ = packed_row(1, 1, DELTA_NET_PACKED, step=1)
        packed = packed_params(segments)
        packed = dataclasses.replace(packed, cu_seqlens_q=packed.cu_seqlens_q.to(device),
                                     cu_seqlens_kv=packed.cu_seqlens_kv.to(device))
        positions = torch.arange(input_ids.size(1)).unsqueeze(0)
        model.eval()
        with torch.no_grad(), Capture(model) as capture:
            model(input_ids.to(device), positions.to(device), None, labels=labels.to(device),
                  loss_mask=mask.to(device), packed_seq_params=packed)
            want, _ = ref(input_ids, segments)
            unseparated, _ = ref(input_ids, torch.zeros_like(segments))
    got = capture.split()[0].float().cpu()
    scale = float(want.abs().max())
    return {"device": "cuda" if torch.cuda.is_available() else "cpu",
            "fla": importlib.util.find_spec("fla") is not None,
            "error": float((got - want).abs().max()) / scale,
            "boundary_effect": float((unseparated - want).abs().max()) / scale}
