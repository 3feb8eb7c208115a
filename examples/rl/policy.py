# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The RL example's policy: its shape by --policy, the model and optimizer that train it, the rollout
model its weights stream into, its frozen heads, and the fingerprints of its weights.

--policy llama (the default): a Llama with MiMo-layout depths. --policy qwen3_5: a tiny Qwen3.5-MoE,
GPTModel with Gated DeltaNet layers (three in four, as examples/configs/qwen3_next_gpt_tiny.sh builds
them) among gated full-attention ones with q/k norms and partial rotary, zero-centred RMSNorms, MoE
with a gated shared expert in every layer trained with an auxiliary load-balancing loss (aux_loss),
and --depths MTP depths of one repeated layer (Qwen3.5's MTP block is one layer, which vLLM and
SGLang run at every drafted position). --policy mimo: Qwen2 with MiMo's MTP depths, one repeated
layer, heads of 32 (what vLLM's CPU build drafts for here).
"""

import hashlib

import torch


def policy_config(args, task, depths: int) -> dict:
    """The policy's shape as its Hugging Face config.json says it (the weight stream's family and names)."""
    shape = {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers, "num_attention_heads": 4,
             "vocab_size": task.vocab_size, "max_position_embeddings": task.sequence_length,
             "num_nextn_predict_layers": depths}
    if args.policy == "llama":
        return {**shape, "architectures": ["LlamaForCausalLM"], "intermediate_size": 4 * args.hidden_size,
                "rms_norm_eps": 1e-5}
    if args.policy == "mimo":
        # Qwen2 with MTP (q/k/v biases): two heads, so heads of 32 at hidden 64 (vLLM's CPU attention's
        # smallest); positions for twice a rollout (vLLM counts the prompt and every response token,
        # the last included, against the model's length)
        return {**shape, "architectures": ["MiMoForCausalLM"], "num_attention_heads": 2, "num_key_value_heads": 1,
                "intermediate_size": 4 * args.hidden_size, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 2 * task.sequence_length}
    # Qwen3.5-MoE, tiny: every fourth layer gated full attention (q/k norms, a quarter of each head
    # rotated), the others Gated DeltaNet with 2 key heads (a multiple of CP = 2: whole heads per rank
    # after its all-to-all); experts and a gated shared expert in every layer and MTP depth.
    return {**shape, "architectures": ["Qwen3_5MoeForCausalLM"], "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": args.hidden_size // 2,
            "shared_expert_intermediate_size": args.hidden_size // 2}


def build(args, task):
    """The policy (DDP-wrapped chunks, its optimizer, its MTP depths, the arguments a checkpoint of it
    would hold) and the rollout engine's model, whose weights stream in the family's Hugging Face
    names."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_mtp.library.initialize import initialize_distributed
    from megatron_mtp.library.model import build_model
    from megatron_mtp.serving import model as serving_model
    from megatron_mtp.serving.config import ModelConfig

    initialize_distributed(1, 1, None, args.seed, cp=args.context_parallel_size)
    depths = 0 if args.heads == "none" else args.depths
    shape = ModelConfig.from_hf(policy_config(args, task, depths), pad_to=1)
    # Qwen3.5's MTP block is one layer, which vLLM and SGLang run at every drafted position (its
    # layout streams one), and vLLM runs MiMo's first MTP layer at every drafted position: D depths
    # of one repeated layer
    shape.mtp_repeated = args.policy in ("qwen3_5", "mimo")
    policy_args = shape.megatron_args()
    # The serving config (one process) made the trainer's: CP, and Qwen3.5's auxiliary loss, which the
    # engine does not compute (an import's arguments hold none)
    router = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3} if policy_args.num_experts \
        else {}
    config = dataclasses.replace(serving_model.transformer_config(policy_args), calculate_per_token_loss=True,
                                 mtp_detach_heads=bool(depths), mtp_loss_scaling_factor=0.3,
                                 mtp_loss_type=args.mtp_loss_type, context_parallel_size=args.context_parallel_size,
                                 **router)
    chunks = build_model(config, task.vocab_size, task.sequence_length)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0,
                                                       clip_grad=1.0),
                                       chunks)  # fp32, not distributed: see --heads frozen
    # The rollout engine's own model (one process, its KV cache), given the policy's weights by the stream
    rollout_model = serving_model.build(policy_args, pg_collection=serving_model.own_groups())
    return chunks, optimizer, depths, policy_args, rollout_model


def digest(model, heads: bool) -> str | None:
    """sha256 of the backbone's parameters (heads=False) or the MTP block's, in name order; None if none."""
    found, hasher = False, hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if name.startswith("mtp.") == heads:
            found = True
            hasher.update(name.encode())
            hasher.update(param.detach().float().contiguous().numpy().tobytes())
    return hasher.hexdigest() if found else None


class FrozenHeads:
    """--heads frozen: the MTP depths keep the weights they had after the warm start, so their drafts
    age as the policy moves. The optimizer steps these fp32 parameters themselves (no distributed
    optimizer, no bf16 main copies), so restoring them after every step is what the next step
    starts from."""

    def __init__(self, model):
        self.model = model
        self.weights = {name: param.detach().clone() for name, param in model.named_parameters()
                        if name.startswith("mtp.")}

    def restore(self) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self.weights:
                    param.copy_(self.weights[name])
