# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The trainer's flags of a model vLLM's CPU build drafts for with the MTP heads: Qwen2's shape (q/k/v
biases, RMSNorm, SwiGLU, RoPE, untied, grouped queries), exported with --architecture mimo and served
as MiMoForCausalLM with its MiMo MTP; heads of at least 32 channels (the CPU attention's smallest), one
repeated MTP layer unless asked otherwise (vLLM runs the draft model's first layer at every draft step).
tests/test_engine.py and benchmarks/vllm_speculative_bench.py train it at their sizes."""


def mimo_model(layers: int, hidden: int, heads: int, query_groups: int, ffn: int, seq_length: int,
               depths: int = 2, repeated: bool = True) -> tuple:
    if hidden // heads < 32:
        raise ValueError(f"heads of {hidden // heads}: vLLM's CPU attention takes 32 or more")
    return ("--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--kv-channels", str(hidden // heads), "--group-query-attention", "--num-query-groups", str(query_groups),
            "--ffn-hidden-size", str(ffn), "--seq-length", str(seq_length), "--max-position-embeddings",
            str(2 * seq_length), "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
            "--disable-bias-linear", "--add-qkv-bias", "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by", "1",
            "--mtp-num-layers", str(depths), *(("--mtp-use-repeated-layer",) if repeated else ()))
