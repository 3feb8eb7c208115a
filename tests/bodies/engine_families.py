# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Every Hugging Face family in vLLM's CPU build (tests/test_engine_families.py): a tiny random model of
the family made by `transformers` in dimensions the CPU kernels accept, imported with one new MTP depth
(tools/convert_checkpoint.py import --mtp-num-layers 1) and exported as the family
(tools/convert_checkpoint.py export --architecture FAMILY), as a user would.

The kernels' constraints, read in vLLM 0.32.0's CPU build: the CPU attention takes head sizes
32, 64, 80, ... (v1/attention/backends/cpu_attn.py, get_supported_head_sizes); both CPU MLA backends
take only the latent head of DeepSeek-V2/V3, kv_lora_rank + qk_rope_head_dim = 512 + 64
(mla/cpu_mla.py and mla/amx_mla.py, get_supported_head_sizes), AMX's in bf16 alone, the reference
CPU_MLA in fp32 too; the CPU Gated DeltaNet asserts bf16 (mamba/ops/cpu/gdn_attention.py) and its
kernels take key / value heads of 128 (measured: 32 stops at `Unexpected head dim size, 32`).

The weights are rounded to bf16 before the import for the families the engine runs in bf16, so that
the engine's bf16 export and the project's fp32 checkpoint hold the same values: what differs is
the arithmetic alone (the test's margin filter is the dtype's).
"""

import subprocess
import sys
from pathlib import Path

import torch

VOCAB = 512
_DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False)
# num_nextn_predict_layers 0: transformers' config says 1 by default, which the model it makes does not hold
_SIGMOID = dict(num_nextn_predict_layers=0, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5)
# Gated DeltaNet at the CPU kernels' head size 128 beside a full-attention layer of heads of 64
_GDN = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"], max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
_GDN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

# family: (transformers config class, its values, the dtype the engine runs it in, vLLM's MTP drafter
# for the family's layout (None: vLLM has none), options to vLLM, export flags)
# MiMo's layout (Llama's, Qwen2's and Qwen3's default) is refused by vLLM's Llama / Qwen2 / Qwen3
# loaders (`There is no module or parameter named 'mtp_layers' in LlamaModel`: AutoWeightsLoader,
# model_executor/models/utils.py), which have no MTP model to take it: exported without the depths
_NO_DEPTHS = ("--mtp-layout", "none")
FAMILIES = {
    "llama": ("LlamaConfig", _DENSE, "fp32", None, {}, _NO_DEPTHS),
    "qwen2": ("Qwen2Config", _DENSE, "fp32", None, {}, _NO_DEPTHS),
    "qwen3": ("Qwen3Config", _DENSE, "fp32", None, {}, _NO_DEPTHS),
    # DeepSeek-V3's layout (the default): vLLM's Qwen3-MoE loader refuses `layers.2` (no module), as above
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True), "fp32", None, {}, _NO_DEPTHS),
    # bf16: in fp32 (the reference CPU_MLA backend) the engine stopped at start with `expect weight to be
    # bfloat16, float16, int8, fp8_e4m3 or uint8`
    "deepseek_v3": ("DeepseekV3Config", dict(_DENSE, **_SIGMOID, q_lora_rank=64, kv_lora_rank=512,
                                             qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                                             num_key_value_heads=2),
                    "bf16", "DeepSeekMTP", {}, ()),
    "glm4_moe": ("Glm4MoeConfig", dict(_DENSE, **_SIGMOID, attention_bias=True, use_qk_norm=True,
                                       partial_rotary_factor=0.5), "fp32", "Glm4MoeMTP", {}, ()),
    # Gated DeltaNet: no prefix caching, whose state copies with drafts are a Triton kernel the CPU
    # build does not override (v1/worker/mamba_utils.py, run_fused_precopy)
    "qwen3_next": ("Qwen3NextConfig", dict(_GDN, **_EXPERTS, norm_topk_prob=True, partial_rotary_factor=0.25,
                                           rope_theta=1e6),
                   "bf16", "Qwen3NextMTP", {"enable_prefix_caching": False}, ()),
    "qwen3_5": ("Qwen3_5TextConfig", dict(_GDN, **_GDN_ROPE), "bf16", "Qwen3_5MTP",
                {"enable_prefix_caching": False}, ()),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict({k: v for k, v in _GDN.items() if k != "intermediate_size"},
                                                 **_EXPERTS, **_GDN_ROPE),
                    "bf16", "Qwen3_5MoeMTP", {"enable_prefix_caching": False}, ()),
}


def _randomize(model) -> None:
    """Norms away from their initialization and weights large enough that greedy decisions stand
    clear of the engines' round-off (most of the time: the test filters the others)."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.normal_(1, 0.2)
            elif name.endswith(("e_score_correction_bias", "dt_bias")):
                tensor.normal_(0, 0.1)
            elif tensor.dim() == 2:
                tensor.normal_(0, 1.0 / tensor.shape[-1] ** 0.5)


def export(root: str, family: str, seed: int = 3) -> dict:
    """The family's tiny model: transformers' (root/source), imported with one new MTP depth
    (root/checkpoint; every family, so that each export is loaded with its MTP layout as written,
    drafted from or not) and exported as the family (root/hf) in the engine's dtype."""
    import transformers

    config_name, values, dtype, _, _, flags = FAMILIES[family]
    root = Path(root)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**values)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model)
    if dtype == "bf16":
        model.to(torch.bfloat16).to(torch.float32)
    model.save_pretrained(root / "source")
    tool = [sys.executable, "tools/convert_checkpoint.py"]
    repo = Path(__file__).resolve().parents[2]
    out = {}
    for step, argv in (("import", ["import", str(root / "source"), str(root / "checkpoint"), "--mtp-num-layers", "1",
                                   "--make-vocab-size-divisible-by", "1"]),
                       ("export", ["export", str(root / "checkpoint"), str(root / "hf"), "--architecture", family,
                                   "--dtype", dtype, *flags])):
        done = subprocess.run(tool + argv, cwd=repo, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{step}: {done.stderr.strip()[-2000:]}")
        out[step] = done.stdout.strip().splitlines()[-1:]
    return out
