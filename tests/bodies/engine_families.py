# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Every Hugging Face family in vLLM's CPU build (tests/test_engine_families.py): a tiny random model of
the family made by `transformers` in dimensions the CPU kernels accept, imported with one new MTP depth
(tools/convert_checkpoint.py import --mtp-num-layers 1) and exported as the family
(tools/convert_checkpoint.py export --architecture FAMILY), as a user would; DeepSeek-V3's,
Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's are trained by the project's trainer instead (TRAINED:
pretrain_gpt_mtp.py on the embedded corpus, their own MTP depth), so that their greedy decisions
stand clear of bf16's round-off, and exported alike.

The kernels' constraints, read in vLLM 0.32.0's CPU build: the CPU attention takes head sizes
32, 64, 80, ... (v1/attention/backends/cpu_attn.py, get_supported_head_sizes); both CPU MLA backends
take only the latent head of DeepSeek-V2/V3, kv_lora_rank + qk_rope_head_dim = 512 + 64
(mla/cpu_mla.py and mla/amx_mla.py, get_supported_head_sizes), AMX's in bf16 alone, the reference
CPU_MLA in fp32 too; the CPU Gated DeltaNet asserts bf16 (mamba/ops/cpu/gdn_attention.py) and its
kernels take key / value heads of 128 (measured: 32 stops at `Unexpected head dim size, 32`).

The weights are rounded to bf16 before the import for the families the engine runs in bf16 (a trained
model's by the project's decoder as it loads them: tests.bodies.engine.decode's rounded_to), so that
the engine's bf16 export and the project's fp32 decoder hold the same values: what differs is the
arithmetic alone (the test's margin filter is the dtype's).
"""

import subprocess
import sys
from pathlib import Path

import torch

from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import example_flags, train

VOCAB = 512
_DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False)
# num_nextn_predict_layers 0: transformers' config says 1 by default, which the model it makes does not hold
_SIGMOID = dict(num_nextn_predict_layers=0, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5)

# DeepSeek-V3 is trained by the project instead: on a random one (kv-LoRA rank 512, as the CPU MLA backends
# take) the greedy decisions (margins <= 0.04) were within bf16's round-off, no prompt clear of it. The run:
# the embedded corpus, long enough that most decisions stand clear and the text is not one token (after
# 100 iterations 48 corpus prompts had 3 distinct greedy continuations, nearly all spaces; after 400, 14).
# The Gated DeltaNet families too (Qwen3-Next's run, Qwen3.5's without its experts, Qwen3.5-MoE's trained
# as Qwen3-Next's, a run of its own with the same flags and seed): their random models' logits reach 5-8,
# where one bf16 step (2^-5) exceeds the test's bf16 margin, so whether a random one passed hung on
# transformers' initialization. On Qwen3.5's, 2 of 16 prompts were clear of it, and on one of them (a
# step's margin 0.06 in fp32) vLLM's verify step computed a tie that its decode step did not. On
# Qwen3-Next's (transformers 5.25's initialization), vLLM's speculative tokens parted from its plain ones
# at a step whose fp32 margin was 0.16, and transformers' own bf16 forward made the same flip (its logits
# moved by up to 0.3)
TRAINED = "pretrain_gpt_mtp.py"
_TRAIN_ITERS = 400
_TRAIN = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
          "--max-position-embeddings", "128", "--make-vocab-size-divisible-by", "1",
          "--untie-embeddings-and-output-weights", "--micro-batch-size", "8", "--global-batch-size", "8",
          "--train-iters", str(_TRAIN_ITERS), "--lr", "3e-3", "--lr-warmup-iters", "0", "--eval-iters", "0")


def _example(name: str, values: dict, dropped: tuple = ()) -> list:
    """examples/configs/NAME.sh's flags with `values` in place of its own (appended where it has none)
    and the flags that begin with one of `dropped` left out."""
    flags, values, kept = example_flags(name), dict(values), []
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            given = []
            for value in flags[i + 1:]:
                if value.startswith("--"):
                    break
                given.append(value)
            if not flag.startswith(dropped):
                kept += [flag, *([values.pop(flag)] if flag in values else given)]
    for flag, value in values.items():
        kept += [flag, value]
    return kept


def _deepseek_v3_flags() -> list:
    """examples/configs/deepseek_v3_tiny.sh on two layers (the first dense, the second MoE), its MLA at
    the CPU MLA backends' latent head: kv-LoRA rank 512 + RoPE dim 64, no-RoPE query / key and value
    heads of 32."""
    return _example("deepseek_v3_tiny", {"--moe-layer-freq": "[0,1]", "--kv-lora-rank": "512",
                                         "--qk-pos-emb-head-dim": "64", "--qk-head-dim": "32", "--v-head-dim": "32"})


def _qwen3_next_flags(dropped: tuple = ()) -> list:
    """examples/configs/qwen3_next_gpt_tiny.sh at the CPU kernels' heads: a Gated DeltaNet layer of key /
    value heads of 128, then a full-attention layer of heads of 64."""
    return _example("qwen3_next_gpt_tiny", {"--linear-attention-freq": "2", "--linear-num-key-heads": "1",
                                            "--linear-num-value-heads": "2", "--linear-key-head-dim": "128",
                                            "--linear-value-head-dim": "128", "--kv-channels": "64"},
                    dropped=dropped)


def _qwen3_5_flags() -> list:
    """Qwen3-Next's without its experts (Qwen3.5's dense MLP)."""
    return _qwen3_next_flags(dropped=("--num-experts", "--moe-"))


# family: (transformers config class and its values, or TRAINED and a function of the trainer's flags,
# the dtype the engine runs it in, options to vLLM). vLLM's MTP drafter for the family is
# its adapter's (megatron_mtp.serving.families: `drafter`); a family without one (Llama, Qwen2, Qwen3,
# Qwen3-MoE) is exported as written all the same: the export leaves its depths out by default, since
# vLLM's loader refuses them (`There is no module or parameter named 'mtp_layers' in LlamaModel`:
# AutoWeightsLoader, model_executor/models/utils.py)
FAMILIES = {
    "llama": ("LlamaConfig", _DENSE, "fp32", {}),
    "qwen2": ("Qwen2Config", _DENSE, "fp32", {}),
    "qwen3": ("Qwen3Config", _DENSE, "fp32", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True), "fp32", {}),
    # trained (TRAINED), bf16: in fp32 (the reference CPU_MLA backend) the engine stopped at start with
    # `expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8`
    "deepseek_v3": (TRAINED, _deepseek_v3_flags, "bf16", {}),
    "glm4_moe": ("Glm4MoeConfig", dict(_DENSE, **_SIGMOID, attention_bias=True, use_qk_norm=True,
                                       partial_rotary_factor=0.5), "fp32", {}),
    # Gated DeltaNet: no prefix caching, whose state copies with drafts are a Triton kernel the CPU
    # build does not override (v1/worker/mamba_utils.py, run_fused_precopy)
    # trained (TRAINED), in bf16 without prefix caching
    "qwen3_next": (TRAINED, _qwen3_next_flags, "bf16", {"enable_prefix_caching": False}),
    "qwen3_5": (TRAINED, _qwen3_5_flags, "bf16", {"enable_prefix_caching": False}),
    "qwen3_5_moe": (TRAINED, _qwen3_next_flags, "bf16", {"enable_prefix_caching": False}),
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


def _random_source(directory: Path, config_name: str, values: dict, dtype: str, seed: int) -> None:
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**values)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model)
    if dtype == "bf16":
        model.to(torch.bfloat16).to(torch.float32)
    model.save_pretrained(directory)


def export(root: str, family: str, seed: int = 3) -> dict:
    """The family's tiny model (root/checkpoint), exported as the family (root/hf) in the engine's dtype.
    The model: transformers' (root/source) imported with one new MTP depth (every family, so that each
    export is loaded as written: its depths in the family's layout where vLLM drafts with them, left
    out by the export's default where it does not), or, for TRAINED, the project's trainer's run (one
    MTP depth of its own)."""
    source, values, dtype, _ = FAMILIES[family]
    root = Path(root)
    steps = []
    if source == TRAINED:
        train(1, *_TRAIN, *values(), "--seed", str(seed), "--save", str(root / "checkpoint"), "--save-interval",
              str(_TRAIN_ITERS), timeout=1200)
    else:
        _random_source(root / "source", source, values, dtype, seed)
        steps.append(("import", ["import", str(root / "source"), str(root / "checkpoint"), "--mtp-num-layers", "1",
                                 "--make-vocab-size-divisible-by", "1"]))
    steps.append(("export", ["export", str(root / "checkpoint"), str(root / "hf"), "--architecture", family,
                             "--dtype", dtype]))
    tool = [sys.executable, "tools/convert_checkpoint.py"]
    out = {}
    for step, argv in steps:
        done = subprocess.run(tool + argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{step}: {done.stderr.strip()[-2000:]}")
        out[step] = done.stdout.strip().splitlines()[-1:]
    return out
