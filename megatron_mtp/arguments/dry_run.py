# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The one line a --dry-run prints: what the run would be."""

from megatron_mtp.arguments import gpus


def summary(args, parameters: int | str) -> str:
    """One line that says what a run would be (--dry-run), with the model's `parameters` (a count,
    or why there is none)."""
    data = "mock data" if args.mock_data else " ".join(args.data_path or []) or "per-split data paths"
    mtp = (f"MTP D={args.mtp_num_layers}{' repeated' if args.mtp_use_repeated_layer else ''}"
           f"{' isolated' if args.mtp_detach_heads else ''}{' frozen backbone' if args.freeze_backbone else ''}, "
           + (f"sparse MTP loss in chunks of {args.sparse_loss_chunk_size} rows" if args.mtp_sparse_loss
              else "dense MTP loss")
           if args.mtp_num_layers else "no MTP")
    attention = ("multi-latent attention" if args.multi_latent_attention
                 else f"grouped-query attention, {args.num_query_groups} groups" if args.group_query_attention
                 else "multi-head attention")
    return (f"pretrain_gpt_mtp.py: arguments OK: world {args.world_size} = DP {args.data_parallel_size} x "
            f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size}"
            + (f" (VPP {args.virtual_pipeline_model_parallel_size})" if args.virtual_pipeline_model_parallel_size
               else "") +
            f" x CP {args.context_parallel_size}; "
            f"{f'HybridModel {args.hybrid_layer_pattern!r}, ' if args.hybrid_layer_pattern else ''}"
            f"{args.num_layers} layers, hidden {args.hidden_size}, "
            f"{args.num_attention_heads} heads ({attention}), vocabulary {args.padded_vocab_size}, "
            f"parameters: {_count(parameters)}; {mtp}; "
            + (f"{args.num_experts} experts (top-{args.moe_router_topk}"
               f"{', grouped GEMM' if args.moe_grouped_gemm else ''}), EP {args.expert_model_parallel_size}"
               f"{' (compute capability checked on the GPUs)' if gpus.capability_deferred(args) else ''}; "
               if args.num_experts else "") +
            f"{'sparse lm loss; ' if args.sparse_lm_loss else ''}"
            f"{args.transformer_impl} layers, {'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}; "
            f"{args.train_iters} iterations of {args.global_batch_size} x {args.seq_length} tokens; data: {data}; "
            f"load: {args.load or '-'}, save: {args.save or '-'}")


def _count(parameters: int | str) -> str:
    if isinstance(parameters, str):
        return parameters
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if parameters >= size:
            return f"{parameters:,} ({parameters / size:.1f}{unit})"
    return f"{parameters:,}"
