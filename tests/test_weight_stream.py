# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Draft weights into the rollout engine (issue 40, E): serving.stream.weights over a live model at
TP = 2, PP = 2 and (MoE) EP = 2 on gloo ranks yields exactly the tensors, by name and byte, that
tools/convert_checkpoint.py export writes from that model's checkpoint, MTP depths included in the
family's engine layout; and the export's output line (and the stream's warnings) say where vLLM is
known to serve the written MTP layout otherwise than megatron-core trained it.
"""

import pytest

from megatron_mtp.serving.config import ModelConfig
from megatron_mtp.serving.export import engine_warnings
from tests.harness import launch

# Llama and Qwen3-MoE have no engine drafter: by default their export leaves the depths out
# (serving.export.plan), so these name the layout to write them in
MIMO, DEEPSEEK = ("--mtp-layout", "mimo"), ("--mtp-layout", "deepseek_v3")
LAYOUTS = {
    "llama-tp2": ("llama", dict(tp=2), MIMO),
    "llama-pp2-mimo-bf16": ("llama", dict(pp=2), (*MIMO, "--dtype", "bf16")),
    "qwen3_moe-ep2": ("qwen3_moe", dict(ep=2), DEEPSEEK),
    "qwen3_moe-tp2-ep2-stacked": ("qwen3_moe", dict(tp=2, ep=2), (*DEEPSEEK, "--expert-layout", "stacked")),
    "llama-tp2-pp2-deepseek_v3": ("llama", dict(tp=2, pp=2), DEEPSEEK),
    "llama-pp2-vpp2": ("llama", dict(pp=2, vpp=2), MIMO),
}
# The default tier runs one launch per parallelism kind; the 4-rank layouts are the matrix's.
DEFAULT = ("llama-tp2", "llama-pp2-mimo-bf16", "qwen3_moe-ep2")


@pytest.mark.parametrize("case", [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.matrix)
                                  for name in LAYOUTS])
def test_the_stream_of_a_live_model_is_the_export_bit_for_bit(case, tmp_path):
    family, layout, options = LAYOUTS[case]
    ranks = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)  # the experts' TP is the model's
    result = launch("tests.bodies.weight_stream:compare", ranks,
                    {"root": str(tmp_path), "family": family, **layout, "options": list(options)}, timeout=400)[0]
    assert result["status"] == 0, result["said"]
    assert result["streamed"] == result["written"] > 0 and result["repeated names"] == 0, result
    assert result["names only one side"] == [] and result["differ"] == [], result
    assert result["mtp names"] > 0, result  # the draft depths are in the stream
    assert result["dtypes"] == (["torch.bfloat16"] if "bf16" in options else ["torch.float32"]), result
    if family == "qwen3_moe":
        assert result["expert names"] > 0, result
    # DeepSeek-V3's layout with 2 depths: vLLM's carried hidden state; MiMo's with 2 distinct depths: the
    # pre-norm states, and the first depth at every step
    expected = ["vllm-project/vllm#45895"] if family == "qwen3_moe" or "deepseek_v3" in options else \
        ["before its final norm", "mtp_layers.0 at every draft step"]
    warned = result["warnings"]
    assert len(warned) == len(expected) and all(e in line for e, line in zip(expected, warned, strict=True)), warned
    for line in result["warnings"]:  # the stream's warnings are the export's output line's
        assert line in result["said"], (line, result["said"])


def _config(family: str, depths: int, repeated: bool = False) -> ModelConfig:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100})
    cfg.family, cfg.mtp_num_layers, cfg.mtp_repeated = family, depths, repeated  # what the warnings read
    return cfg


@pytest.mark.parametrize("family,layout,depths,repeated,issue", [
    ("qwen3_5", "qwen3_next", 2, False, "vllm-project/vllm#52688"),
    ("qwen3_5_moe", "qwen3_next", 3, False, "vllm-project/vllm#52688"),
    ("qwen3_next", "qwen3_next", 2, False, "vllm-project/vllm#52688"),  # Qwen3NextMTP passes no step index
    ("qwen3_5", "qwen3_next", 2, True, None),  # one repeated layer: layers[0] at every step is what it trained
    ("qwen3_5", "qwen3_next", 1, False, None),
    ("deepseek_v3", "deepseek_v3", 2, False, "vllm-project/vllm#45895"),
    ("glm4_moe", "deepseek_v3", 2, True, "vllm-project/vllm#45895"),  # the carried state matters even repeated
    ("deepseek_v3", "deepseek_v3", 1, False, None),  # one draft step carries the main model's (normalized) state
    ("mimo", "mimo", 1, False, ("before its final norm",)),  # vLLM's MiMo drafts from the pre-norm states
    ("mimo", "mimo", 2, True, ("before its final norm",)),
    ("mimo", "mimo", 2, False, ("before its final norm", "mtp_layers.0 at every draft step")),
    ("qwen3_5", None, 2, False, None),  # the backbone only
])
def test_the_export_warns_where_vllm_serves_the_mtp_layout_otherwise(family, layout, depths, repeated, issue):
    warned = engine_warnings(_config(family, depths, repeated), layout)
    expected = issue if isinstance(issue, tuple) else (issue,) if issue else ()
    assert len(warned) == len(expected) and all(e in line for e, line in zip(expected, warned, strict=True)), warned


@pytest.mark.matrix
def test_the_stream_holds_a_part_and_a_batch_not_the_model(tmp_path):
    """The stream's peak memory per rank (benchmarks/weight_stream_bench.py's measurement: VmHWM over the
    resident set after the model is built) at TP = 2 on a 0.7 GB model: in batches of 4 MiB it stays
    below half of what collecting the whole stream takes, which is about the model; the stream holds one
    part of the export (its largest: the 125 MiB embedding) and a batch at a time."""
    rows = {}
    for bucket in (4 << 20, None):
        rows[bucket] = launch("benchmarks.weight_stream_bench:measure", 2, {"tp": 2, "bucket_bytes": bucket},
                              timeout=600)
    whole = min(row["peak MiB"] for row in rows[None])
    batched = max(row["peak MiB"] for row in rows[4 << 20])
    model = rows[None][0]["model MiB"]
    assert whole > 0.9 * model, (whole, model)
    assert batched < 0.5 * whole, (batched, whole)
    assert rows[4 << 20][0]["streamed MiB"] == rows[None][0]["streamed MiB"] == pytest.approx(model, rel=0.01)
