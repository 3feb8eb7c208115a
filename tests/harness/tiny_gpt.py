# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A tiny GPT trained through megatron-core's own stack, for any TP x PP x VPP x DP layout.

Model, step and checkpointing are the trainer's (megatron_mtp). The data here is
made to be hard to get right: one deterministic global batch per step with holes in
the loss mask and very uneven valid-token counts across samples (sample 1 keeps only
3 targets), so that a layout that normalized per micro-batch or per rank would differ
from one process on the whole batch.
"""

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mtp.library.batches import rank_microbatches
from megatron_mtp.library.model import build_model
from megatron_mtp.library.step import train_step as trainer_step


@dataclass
class Setup:
    vocab_size: int = 64
    seq_length: int = 16
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 4
    mtp_num_layers: int = 0
    global_batch: int = 8
    micro_batch: int = 2
    bf16: bool = False
    distributed_optimizer: bool = False
    lr: float = 1e-2
    clip_grad: float = 1.0
    data_seed: int = 7
    mtp_detach_heads: bool = False
    mtp_use_repeated_layer: bool = False
    mtp_loss_type: str = "ce"  # the draft objective (spec section 12) and its temperature
    mtp_draft_temperature: float = 1.0
    tied: bool = False
    # MoE (none by default). DeepSeek-V3-like: no linear biases, SwiGLU, sigmoid scores with
    # an expert bias, a shared expert, seq_aux_loss and z-loss; any upstream value works.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | list = 1
    moe_router_load_balancing_type: str | list = "aux_loss"
    moe_aux_loss_coeff: float | list = 0.0
    moe_z_loss_coeff: float | None = None
    moe_token_dispatcher_type: str = "allgather"
    add_bias_linear: bool = True
    swiglu: bool = False
    # HybridModel instead of GPTModel: the same network, each layer an attention layer then an
    # MLP layer ("*-"), each MTP depth likewise ("/*-"); "|" between (virtual) pipeline stages.
    hybrid: bool = False
    # An architecture of ARCHITECTURES (its TransformerConfig fields), "" for the default GPT.
    arch: str = ""


# The architectures MTP models use (issue 27), as TransformerConfig fields for Setup.arch:
# Qwen3's attention (q/k RMSNorm) with Qwen3-Next's output gate; DeepSeek-V3's multi-latent
# attention (q- and kv-LoRA, YaRN, q/k RMSNorm); Qwen3-Next's Gated DeltaNet (a hybrid setup's
# first layer "G", needs SwiGLU, whose convolution and gate use SiLU), and the same layers as a
# GPTModel (--experimental-attention-variant gated_delta_net: every second layer full attention).
_DELTA_NET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, normalization="RMSNorm", gated_linear_unit=True)
ARCHITECTURES = {
    "": {},
    "qk_rmsnorm_gate": dict(qk_layernorm=True, normalization="RMSNorm", attention_output_gate=True),
    "mla_yarn": dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                     qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="yarn", rotary_scaling_factor=4.0,
                     original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.5, qk_layernorm=True,
                     normalization="RMSNorm"),
    "delta_net": _DELTA_NET,
    "delta_net_gpt": dict(_DELTA_NET, experimental_attention_variant="gated_delta_net", linear_attention_freq=2),
}


def reference_architecture(setup: Setup):
    """The plain-PyTorch reference's Architecture (tests/reference/gpt_mtp.py) of the setup's
    attention (the MLPs are the setup's own: dense, or MoE by tests/reference/moe.py)."""
    from tests.reference.gpt_mtp import Architecture, DeltaNet, Latent

    net = ARCHITECTURES["delta_net"]
    delta_net = DeltaNet(net["linear_num_key_heads"], net["linear_num_value_heads"], net["linear_key_head_dim"],
                         net["linear_value_head_dim"], net["linear_conv_kernel_dim"])
    return {
        "": Architecture(),
        "qk_rmsnorm_gate": Architecture("RMSNorm", qk_norm=True, output_gate=True),
        # (q-LoRA, kv-LoRA, q/k head, rope head, v head); YaRN: (factor, original context, beta_fast, beta_slow,
        # mscale, mscale_all_dim), upstream's beta defaults
        "mla_yarn": Architecture("RMSNorm", qk_norm=True,
                                 latent=Latent(16, 8, 8, 8, 8, yarn=(4.0, 4096, 32, 1, 1.0, 0.5))),
        # the first layer's mixer is the Gated DeltaNet (hybrid_layer_pattern)
        "delta_net": Architecture("RMSNorm", swiglu=True, linear_layers=frozenset({0}), delta_net=delta_net),
        # upstream's --linear-attention-freq 2: every second layer full attention, the others Gated DeltaNet
        "delta_net_gpt": Architecture("RMSNorm", swiglu=True, delta_net=delta_net,
                                      linear_layers=frozenset(range(0, setup.num_layers, 2))),
    }[setup.arch]


def architecture_config(setup: Setup):
    """(the config class, its fields) of the setup's architecture: MLA's config class, or this
    module's TransformerConfig (which tests.bodies.mtp_layouts may wrap for a call)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = dict(ARCHITECTURES[setup.arch])
    if fields.get("gated_linear_unit"):
        fields["activation_func"] = F.silu
    return (MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig), fields


def hybrid_layer_pattern(setup: Setup, stages: int) -> str:
    """The setup's network as upstream's hybrid pattern, its layers split evenly over `stages`
    (with Gated DeltaNet, the first layer's mixer is one, "G"; with experts every MLP, the MTP
    depths' too, is an MoE layer "E", as in Qwen3-Next)."""
    per_stage, rest = divmod(setup.num_layers, stages)
    assert rest == 0, "a hybrid setup's layers split evenly over the pipeline stages"
    assert not setup.num_moe_experts or setup.moe_layer_freq == 1, "a hybrid setup's MLPs are all MoE or all dense"
    layer = "*E" if setup.num_moe_experts else "*-"
    pattern = "|".join([layer * per_stage] * stages)
    if setup.arch == "delta_net":
        pattern = "G" + pattern[1:]
    return pattern + f"/{layer}" * setup.mtp_num_layers


def moe_config_kwargs(setup: Setup) -> dict:
    """TransformerConfig arguments of the MoE fields (none without experts: upstream's defaults)."""
    if not setup.num_moe_experts:
        return {}
    import torch.nn.functional as F

    tp = parallel_state.get_tensor_model_parallel_world_size()
    return dict(
        num_moe_experts=setup.num_moe_experts, moe_router_topk=setup.moe_router_topk,
        moe_router_score_function=setup.moe_router_score_function,
        moe_router_pre_softmax=setup.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=setup.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=setup.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=setup.moe_router_bias_update_rate,
        moe_ffn_hidden_size=setup.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=setup.moe_shared_expert_intermediate_size,
        moe_layer_freq=setup.moe_layer_freq,
        moe_router_load_balancing_type=setup.moe_router_load_balancing_type,
        moe_aux_loss_coeff=setup.moe_aux_loss_coeff, moe_z_loss_coeff=setup.moe_z_loss_coeff,
        moe_token_dispatcher_type=setup.moe_token_dispatcher_type,
        add_bias_linear=setup.add_bias_linear,
        gated_linear_unit=setup.swiglu, activation_func=F.silu if setup.swiglu else F.gelu,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=tp,
        sequence_parallel=tp > 1,  # upstream: MoE with tensor parallelism needs it
    )


def build(setup: Setup, vpp: int | None = None):
    """Model chunks (DDP-wrapped) and optimizer on the current layout."""
    dtype = torch.bfloat16 if setup.bf16 else torch.float32
    stages = parallel_state.get_pipeline_model_parallel_world_size() * (vpp or 1)
    pattern = hybrid_layer_pattern(setup, stages) if setup.hybrid else None
    config_class, arch_fields = architecture_config(setup)
    moe_fields = moe_config_kwargs(setup)
    # (Gated DeltaNet's SwiGLU is both an architecture field and an MoE one: they must agree)
    clash = sorted(k for k in moe_fields.keys() & arch_fields.keys() if moe_fields[k] != arch_fields[k])
    assert not clash, f"the setup's MoE fields contradict its architecture's: {clash}"
    config = config_class(
        num_layers=setup.num_layers * (2 if setup.hybrid else 1),  # a hybrid layer is half a GPT layer
        hidden_size=setup.hidden_size,
        num_attention_heads=setup.num_heads,
        mtp_num_layers=setup.mtp_num_layers or None,
        mtp_detach_heads=setup.mtp_detach_heads,
        mtp_use_repeated_layer=setup.mtp_use_repeated_layer,
        mtp_loss_type=setup.mtp_loss_type,
        mtp_draft_temperature=setup.mtp_draft_temperature,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=setup.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        calculate_per_token_loss=True,
        **moe_fields | arch_fields,
    )
    chunks = build_model(config, setup.vocab_size, setup.seq_length,
                         use_distributed_optimizer=setup.distributed_optimizer,
                         share_embeddings_and_output_weights=setup.tied, hybrid_layer_pattern=pattern)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=setup.lr, clip_grad=setup.clip_grad, bf16=setup.bf16,
                        params_dtype=dtype, use_distributed_optimizer=setup.distributed_optimizer),
        chunks,
    )
    return chunks, optimizer, config


def drop_moe_metrics_tracker() -> None:
    """Drop upstream's global MoE metrics (its per-layer slots keep the size of the first model
    that recorded): megatron-core 0.19's MoEMetricsTracker, 0.16.1's aux-losses tracker dict."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # 0.16.1
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def global_batch(setup: Setup, step: int):
    """Tokens [B, S+1] and a loss mask [B, S] with holes; sample 1 is almost fully masked."""
    gen = torch.Generator().manual_seed(setup.data_seed * 1000 + step)
    tokens = torch.randint(0, setup.vocab_size, (setup.global_batch, setup.seq_length + 1), generator=gen)
    mask = (torch.rand(setup.global_batch, setup.seq_length, generator=gen) > 0.3).float()
    mask[1, 3:] = 0.0
    return tokens, mask


def train_step(setup: Setup, chunks, optimizer, step: int) -> dict:
    tokens, mask = global_batch(setup, step)
    return trainer_step(chunks, optimizer, rank_microbatches(tokens, mask, setup.micro_batch), setup.seq_length)
