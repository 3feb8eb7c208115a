# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What the benchmarks share: the model shape, one process's gloo world, one training step of
a micro-batch, and the peak of live tensor memory during a step."""

import os

SHAPE = dict(vocab=8192, hidden=256, heads=8, layers=4, seq=256, batch=4)
# The MoE variant of SHAPE (TransformerConfig fields): the first layer dense, the other three
# and every MTP depth's layer MoE, 8 SequentialMLP experts of hidden 512 with top-2 routing
# (as many multiply-adds per token as the dense MLP's 4h = 1024), softmax router,
# seq_aux_loss and z-loss, the alltoall dispatcher (EP = 1 here), no linear biases (as
# DeepSeek-V3; pristine upstream's experts add their bias in place of a view and fail on CPU,
# which the fork's patch "MoE experts: add the expert bias out of place" fixes).
MOE = dict(add_bias_linear=False, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512,
           moe_layer_freq=[0, 1, 1, 1],
           moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=1e-3,
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
# The architectures MTP models use, at SHAPE (TransformerConfig fields; hybrid_layer_pattern
# builds a HybridModel, its MTP depths "/*-" appended): DeepSeek-V3's, multi-latent attention
# (q- and kv-LoRA, YaRN with both mscales, q/k RMSNorm) with the MoE layers of MOE; Qwen3-Next's,
# Gated DeltaNet as every other mixer beside gated attention, SwiGLU and RMSNorm (dense MLPs).
ARCHITECTURES = {
    "mla_moe": dict(MOE, multi_latent_attention=True, q_lora_rank=128, kv_lora_rank=64, qk_head_dim=32,
                    qk_pos_emb_head_dim=16, v_head_dim=32, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0,
                    mscale_all_dim=1.0, qk_layernorm=True, normalization="RMSNorm"),
    "delta_net": dict(hybrid_layer_pattern="G-*-G-*-", linear_num_key_heads=4, linear_num_value_heads=8,
                      linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                      attention_output_gate=True, normalization="RMSNorm", gated_linear_unit=True),
}


def setup_process() -> None:
    """A gloo world of one process with megatron-core's parallel state (TP = PP = 1)."""
    import torch.distributed as dist

    from tests.harness.launcher import free_port

    # A free port, not one derived from the pid: benchmark processes start one after another.
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo")
    from megatron_mtp.library.initialize import initialize_model_parallel

    initialize_model_parallel(1, 1, None, 1234)


def build(depths: int, detach: bool = False, repeated: bool = False, vocab: int = SHAPE["vocab"],
          seq: int = SHAPE["seq"], batch: int = SHAPE["batch"], **config_fields):
    """GPT of SHAPE with `depths` MTP depths (SDPA layer spec, fixed seed) and a batch of tokens;
    `config_fields`: further TransformerConfig fields (MLATransformerConfig's with multi-latent
    attention; `hybrid_layer_pattern`: a HybridModel of that pattern instead)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from megatron_mtp.library.model import build_gpt, build_hybrid

    pattern = config_fields.pop("hybrid_layer_pattern", None)
    if config_fields.get("gated_linear_unit"):
        config_fields["activation_func"] = F.silu
    config_class = MLATransformerConfig if config_fields.get("multi_latent_attention") else TransformerConfig
    # a HybridModel counts mixers and MLPs as layers of their own
    config = config_class(num_layers=len(pattern) if pattern else SHAPE["layers"], hidden_size=SHAPE["hidden"],
                               num_attention_heads=SHAPE["heads"], mtp_num_layers=depths or None,
                               mtp_detach_heads=detach, mtp_use_repeated_layer=repeated,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               calculate_per_token_loss=True, **config_fields)
    if config.num_moe_experts:
        # megatron-core's MoE metrics tracker is process-global and sized by the first model's
        # layers: start afresh for this one.
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    torch.manual_seed(0)
    if pattern:
        model = build_hybrid(config, vocab, seq, pattern + "/*-" * depths)
    else:
        model = build_gpt(config, vocab, seq)
    tokens = torch.randint(0, vocab, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(1))
    return model, tokens


def step(model, tokens, valid_fraction: float = 1.0, cp_group=None) -> None:
    """Forward and backward of one micro-batch; with valid_fraction < 1 the leading
    1 - valid_fraction of every row is masked (an RL or SFT prompt); with `cp_group` (context
    parallelism) the rank's pieces of the rows (upstream's load-balanced split)."""
    import torch

    from megatron.core.fork.runtime import context_parallel

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.size(1)).unsqueeze(0).expand_as(inputs)
    mask = torch.ones_like(labels, dtype=torch.float)
    mask[:, :round(labels.size(1) * (1 - valid_fraction))] = 0.0
    if cp_group is not None:
        inputs, labels, positions, mask = (context_parallel.shard(t, 1, cp_group)
                                           for t in (inputs, labels, positions, mask))
    model.zero_grad(set_to_none=True)
    out = model(inputs, positions, None, labels=labels, loss_mask=mask)
    (out * mask).sum().backward()


def peak_step_memory_mib(model, tokens, valid_fraction: float = 1.0, cp_group=None) -> float:
    """Peak of live CPU tensor memory during one step (after a warm-up step), from every
    allocation and free that torch.profiler records: deterministic, unlike resident memory."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    step(model, tokens, valid_fraction, cp_group)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step(model, tokens, valid_fraction, cp_group)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(categories) for categories in sizes) / 2**20


def peak_step_heap_mib(run_step) -> float:
    """Peak growth of the process's malloc heap in use during `run_step()` (after a warm-up
    call), sampled after every tensor operation, forward and backward: glibc's mallinfo2 counts
    the bytes in use, and torch's CPU tensors are allocated by malloc. For steps with
    collectives, which torch.profiler's memory timeline (peak_step_memory_mib) cannot follow
    (its data-flow analysis rejects the in-place outputs of gloo's all-gather)."""
    import ctypes

    from torch.utils._python_dispatch import TorchDispatchMode

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    class Sampling(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.peak = in_use()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use())
            return out

    run_step()
    start = in_use()
    with Sampling() as sampling:
        run_step()
    return (sampling.peak - start) / 2**20
