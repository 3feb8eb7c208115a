# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The checks of the arguments that neither Megatron-LM's validate_args nor the TransformerConfig
refuse, or refuse only once something is built: each one line, before anything is built."""

import os

from megatron_mtp import moe_arguments
from megatron_mtp.arguments import gpus
from megatron_mtp.arguments.errors import ArgumentError


def check(args) -> None:
    """What neither Megatron-LM's validate_args nor the TransformerConfig's checks (upstream's
    and the fork's MTP options, megatron.core.fork.mtp.options) refuse, or refuse only once
    something is built, in one message (the checkpoint directories': checkpoints). Theirs reach the user
    as one line too (`errors.fail`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        value = getattr(args, name)
        if value is None or value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("train_iters", "global_batch_size", "save_interval", "eval_interval", "log_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.lr is None:
        raise ArgumentError("give --lr (the peak learning rate)")
    if args.train_iters is None and args.train_samples is None:
        raise ArgumentError("give --train-iters (or --train-samples)")
    if args.eval_iters is not None and args.eval_iters < 0:
        raise ArgumentError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if cp > 1 and args.seq_length % (2 * cp):
        raise ArgumentError(f"--seq-length {args.seq_length} does not split into 2 x --context-parallel-size = "
                            f"{2 * cp} equal chunks (upstream's load-balanced layout): use a multiple of {2 * cp}")
    dp, uneven = divmod(world, tp * pp * cp)  # uneven: Megatron-LM's validate_args refuses the world size
    if args.global_batch_size is not None and not uneven and args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    decay = args.lr_decay_iters or args.train_iters
    if decay is not None and args.lr_warmup_iters >= decay:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below the decay length "
                            f"(--lr-decay-iters, else --train-iters) {decay}")
    depths = args.mtp_num_layers or 0
    if args.sparse_lm_loss and args.main_loss_level == "sequence":
        raise ArgumentError("--sparse-lm-loss needs the token-level main loss (its per-token losses weighted by "
                            "the loss mask); drop it or use --main-loss-level token")
    if args.freeze_backbone and not (depths and args.mtp_detach_heads):
        raise ArgumentError("--freeze-backbone trains the MTP heads only: it needs --mtp-num-layers D >= 1 and "
                            "--mtp-detach-heads (isolation keeps the heads' loss off the frozen backbone)")
    if args.transformer_impl == "transformer_engine" and not args.dry_run and gpus.missing("transformer_engine"):
        raise ArgumentError("--transformer-impl transformer_engine needs Transformer Engine, which is not installed "
                            "(pip install -e '.[gpu]'), or --transformer-impl local")
    pattern = args.hybrid_layer_pattern
    if pattern is not None and args.transformer_impl != "transformer_engine":
        others = layers_needing_te(pattern)
        if others:
            raise ArgumentError(f"--hybrid-layer-pattern layers {' '.join(others)} need Transformer Engine (Mamba 'M' "
                                "also mamba-ssm's CUDA kernels); without it the hybrid layers are attention '*', "
                                "MLP '-', MoE 'E' (with --num-experts) and Gated DeltaNet 'G'")
        if "E" in pattern and not args.num_experts:
            raise ArgumentError("--hybrid-layer-pattern has MoE layers 'E': give --num-experts")
    import torch

    check_gated_delta_net_kernels(args, on_gpu=torch.cuda.is_available())
    if gated_delta_net(args) and not args.swiglu:
        # GatedDeltaNet's convolution (FLA's causal_conv1d, or its PyTorch form here) takes SiLU only,
        # and the layer gates its output with the same activation.
        raise ArgumentError("Gated DeltaNet layers (--hybrid-layer-pattern 'G', --experimental-attention-variant "
                            "gated_delta_net) use the model's activation in their convolution and output gate, SiLU "
                            "only (upstream's): give --swiglu")
    if args.reset_attention_mask:
        # Megatron-LM's pretrain_gpt.py passes the dataset's per-document mask to the model; this
        # trainer passes none (its attention is causal without one), so the flag would do nothing.
        raise ArgumentError("--reset-attention-mask is not supported: this trainer's attention is causal over the "
                            "whole sequence (no mask is passed to the model), so documents would still attend "
                            "across their boundaries; drop it (--reset-position-ids still restarts positions)")
    moe_arguments.check(args, world, ArgumentError)


def schedule_plan(args) -> None:
    """--overlap-moe-expert-parallel-comm runs the step through upstream's schedule plan
    (combined 1F1B, forward_step(..., return_schedule_plan=True)): CUDA streams and events
    only, and its MTP nodes re-implement the MTP layer outside the patched block."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False) or not args.mtp_num_layers:
        return
    raise ArgumentError("--overlap-moe-expert-parallel-comm runs the MTP layers through upstream's schedule plan "
                        "(combined 1F1B), which bypasses this project's exact MTP step (head isolation, repeated "
                        "layers, the last depth at the rows its loss reads): drop it, or train without "
                        "--mtp-num-layers")


LOCAL_HYBRID_LAYERS = "*-EG"  # megatron.core.fork.runtime.specs.get_hybrid_stack_spec


def layers_needing_te(pattern: str | None) -> list[str]:
    """The layer symbols of a --hybrid-layer-pattern that the local (torch) hybrid stack does not
    build, sorted (Mamba's 'M' needs Transformer Engine and mamba-ssm's CUDA kernels)."""
    return sorted(set(pattern or "") - set(LOCAL_HYBRID_LAYERS) - set("|/"))


def gated_delta_net(args) -> bool:
    pattern = args.hybrid_layer_pattern or ""
    return "G" in pattern or getattr(args, "experimental_attention_variant", None) == "gated_delta_net"


def check_gated_delta_net_kernels(args, on_gpu: bool) -> None:
    """Upstream's Gated DeltaNet computes with flash-linear-attention's kernels on GPUs (the
    runtime part's PyTorch forms serve machines without CUDA only)."""
    if on_gpu and gated_delta_net(args) and not args.dry_run and gpus.missing("fla"):
        raise ArgumentError("Gated DeltaNet layers on GPUs compute with flash-linear-attention's kernels "
                            "(upstream's), which is not installed: pip install flash-linear-attention")
