# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Mixture-of-experts arguments of pretrain_gpt_mtp.py checked before anything is built.

Each refusal is one line naming the fix: what megatron-core would assert later on every
rank (top-k, expert counts, the expert-parallel layout), the paths that need a CUDA-only
kernel on a machine without CUDA (a --dry-run of a Transformer Engine run, as the GPU
scripts', checks them as on its GPUs), and what an exact step cannot normalize
(megatron.core.fork.mtp.router_losses).
"""

from types import SimpleNamespace

# Flag -> (is it on?, the alternative that runs without CUDA).
CUDA_ONLY = {
    "--moe-permute-fusion": (lambda a: a.moe_permute_fusion, "drop it (megatron-core's unfused permutation)"),
    "--moe-router-fusion": (lambda a: a.moe_router_fusion, "drop it (the unfused router)"),
    "--moe-token-dispatcher-type flex": (lambda a: a.moe_token_dispatcher_type == "flex",
                                         "use --moe-token-dispatcher-type alltoall or allgather"),
    "--moe-enable-deepep": (lambda a: getattr(a, "moe_enable_deepep", False),
                            "use --moe-token-dispatcher-type alltoall"),
    "--moe-use-legacy-grouped-gemm": (lambda a: getattr(a, "moe_use_legacy_grouped_gemm", False),
                                      "drop it (SequentialMLP experts)"),
    # upstream's schedule plan (combined 1F1B): CUDA streams and events only
    "--overlap-moe-expert-parallel-comm": (lambda a: getattr(a, "overlap_moe_expert_parallel_comm", False),
                                           "drop it (the dispatch and combine are not overlapped)"),
}


def targets_cuda(args) -> bool:
    """Whether the run has CUDA: this machine's, or, for a --dry-run of a Transformer Engine
    run (the GPU scripts), the GPUs it declares it is for: the dry run checks the CUDA-only
    flags as there. A run without --dry-run is checked on this machine."""
    import torch

    return torch.cuda.is_available() or (getattr(args, "dry_run", False)
                                         and args.transformer_impl == "transformer_engine")


def check(args, world: int, error) -> None:
    """Raise `error(message)` for MoE arguments that cannot run; nothing without experts."""
    experts = args.num_experts
    if not experts:
        return
    if args.moe_router_topk > experts:
        raise error(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {experts}: each token "
                    "is routed to top-k distinct experts")
    ep = args.expert_model_parallel_size
    if experts % ep:
        raise error(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep} "
                    "(each expert-parallel rank holds the same number of experts)")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    if world % (etp * ep * pp):
        raise error(f"world size {world} is not a multiple of expert-tensor x expert x pipeline parallel "
                    f"= {etp} x {ep} x {pp}: choose --expert-model-parallel-size to divide the data-parallel ranks")
    if not targets_cuda(args):
        for flag, (on, alternative) in CUDA_ONLY.items():
            if on(args):
                raise error(f"{flag} needs a CUDA kernel and this machine has no CUDA: {alternative}")
        if args.moe_grouped_gemm and args.transformer_impl == "transformer_engine":
            raise error("--moe-grouped-gemm with Transformer Engine layers needs CUDA: drop it (SequentialMLP "
                        "experts) or --transformer-impl local")
    from megatron.core.fork.mtp import router_losses

    try:
        router_losses.check_exact_step(SimpleNamespace(
            num_moe_experts=experts, moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
            context_parallel_size=args.context_parallel_size))
    except ValueError as refusal:
        raise error(str(refusal)) from None
