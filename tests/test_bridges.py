# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Hugging Face bridges for the MoE, multi-latent attention and Gated DeltaNet families (issue 27):
tools/convert_checkpoint.py on Qwen3-MoE, DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 against the
`transformers` classes installed here, on tiny random configs made locally (tests/bodies/bridges.py,
one process).

- The imported model's logits equal transformers' (fp32, relative 1e-5): Qwen3-MoE with a
  dense first layer and normalized top-k probabilities, and with experts on every second layer
  and softmax before top-k; DeepSeek-V3 with MLA (q- and kv-LoRA, YaRN with both mscales), a
  dense first layer, sigmoid routing with an expert bias over 2 groups, a shared expert and a
  routed scaling factor; GLM-4.5 with QKV biases, q/k norms, rotary on half of each head and
  DeepSeek-V3's routing; Qwen3-Next (megatron-core's GPTModel with --experimental-attention-variant
  gated_delta_net) with Gated DeltaNet layers of 2 key heads over 4 value heads, gated attention
  with q/k norms and rotary on half of each head, (1 + w) norms, experts beside a gated shared
  expert, its layers every third full attention, and in another order (a list pattern) with a
  dense first layer and softmax before top-k; Qwen3.5 with Qwen3-Next's shapes, dense and with
  experts in every layer (Gated DeltaNet's in_proj_qkv / _z / _b / _a, the multimodal rotary's
  sections at text positions).
- The two MTP depths of DeepSeek-V3 and GLM-4.5, in DeepSeek-V3's layout, and of Qwen3-Next and
  Qwen3.5 (dense and MoE), in Qwen3-Next's (mtp.layers.{k}, one mtp.fc and set of norms), equal a forward
  written from the engines' MTP
  semantics on the Hugging Face tensors (relative 1e-5).
- Import then export gives the original tensors bit for bit (the MTP depths and the copies its
  loaders read included; Qwen3-Next's Gated DeltaNet output norm, shifted by one, below 0.5 too),
  the config the loaders read, and transformers loads the export with the same logits; the
  Qwen3.5-MoE import also as Qwen3-Next (--architecture qwen3_next).
- Qwen3.5's published VLM form (written here: text_config, model.language_model.*, a vision
  tower; transformers' Qwen3_5ForCausalLM loads it with the original's logits) imports as the
  text-only checkpoint does, bit for bit, and exports as the text-only checkpoint, bit for bit.
- What megatron-core would compute otherwise is refused in one line with nothing written:
  unnormalized sigmoid top-k, group scores over other than 2 experts, DeepSeek-V3 weights without
  interleaved rotary pairs, YaRN with another original context; Qwen3-Next's MTP depths on a last
  Gated DeltaNet layer, value heads not grouped by key head, no shared expert, attention biases,
  and MTP depths with their own fc exported in its layout (which holds one); Qwen3.5's attention
  biases, a VLM config without text_config, a model with dense layers or softmax before top-k
  exported as Qwen3.5-MoE, a Qwen3.5 exported as another family.
- Decoding the DeepSeek-V3 import over the KV cache (multi-latent attention's rotary positions
  counted from each forward's first position), speculative and greedy, gives the whole-sequence
  recompute's tokens and draft logits (relative 1e-5); eval_speculative.py runs on it. So does
  decoding the Qwen3-Next, Qwen3.5 and Qwen3.5-MoE imports, whose Gated DeltaNet layers continue
  from the cached convolution inputs and recurrent state (greedy and Gumbel; rejection sampling's
  verify steps against a whole-sequence forward), each verify step running its 1 + D positions
  through each Gated DeltaNet layer whatever the prefix; eval_speculative.py runs on Qwen3-Next's.
- Stacked experts (mlp.experts.gate_up_proj / down_proj, as transformers 5 holds them): every MoE
  family imports them as the per-expert checkpoint, bit for bit, and exports per expert, stacked
  or (by default) in the family's published layout, bit for bit; bad stacks refused in one line.
- The trainer loads the Qwen3-Next and dense Qwen3.5 imports (one rank) and the DeepSeek-V3 import
  (EP = 2, matrix tier) with the flags the import wrote, and trains their MTP depths with the backbone frozen: every
  backbone tensor after training is the imported one, bit for bit; the trained checkpoint decodes
  over its cache as the whole-sequence recompute does.
"""

import pytest

from tests.harness.launcher import launch
from tests.harness.trainer import TINY, train

PARITY = 1e-5  # relative, fp32 (measured <= 8.7e-7: Qwen3.5's)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridges")
    return {**launch("tests.bodies.bridges:check", 1, {"root": str(root)}, timeout=600)[0], "root": root}


def part(results, name):
    result = results[name]
    if set(result) == {"error"}:
        pytest.fail(f"{name}:\n{result['error']}", pytrace=False)
    return result


def entry(results, family, name=None):
    """A part's result, or one of its models' (`name`)."""
    result = part(results, family)
    return result[name] if name else result


def _round_trip(entry, shifted=()):
    """Logits parity both ways and the original tensors back bit for bit, except `shifted`: tensors
    an fp32 export writes as the model computes with them, (w - 1) + 1, where fp32 w < 0.5 cannot
    hold w - 1."""
    assert entry["import"][0] == 0 and entry["export"][0] == 0, (entry["import"], entry["export"])
    assert entry["logits"] <= PARITY, entry["logits"]
    assert not entry["names only one side"] and entry["tensors"], entry
    assert set(entry["differing"]) <= set(shifted), entry["differing"]
    assert entry["differing"] == entry["differing as the model computes them"], entry
    assert not entry["differing at w >= 0.5"], entry
    assert entry["export's logits"] <= PARITY, entry["export's logits"]


# Gated DeltaNet's output norm, (w) in transformers, (1 + w') in megatron-core: each model's Gated DeltaNet layers
SHIFTED = {"qwen3_next": ["model.layers.0.linear_attn.norm.weight", "model.layers.1.linear_attn.norm.weight"],
           "qwen3_next_layers": ["model.layers.1.linear_attn.norm.weight"]}
SHIFTED["qwen3.5"] = SHIFTED["qwen3.5-moe"] = SHIFTED["qwen3_next"]


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-moe-pre-softmax"])
def test_qwen3_moe_imports_with_transformers_logits_and_exports_bit_for_bit(results, name):
    entry = part(results, "qwen3_moe")[name]
    _round_trip(entry)
    assert entry["config"]["architectures"] == ["Qwen3MoeForCausalLM"]
    assert ("--moe-router-pre-softmax" in entry["flags"]) == (name == "qwen3-moe-pre-softmax"), entry["flags"]
    layers = "[0,1,1]" if name == "qwen3-moe" else "[0,1,0]"
    assert entry["flags"][entry["flags"].index("--moe-layer-freq") + 1] == layers, entry["flags"]


def test_glm_4_5_imports_with_transformers_logits_and_exports_bit_for_bit(results):
    entry = part(results, "glm_4_5")
    _round_trip(entry)
    config = entry["config"]
    assert config["architectures"] == ["Glm4MoeForCausalLM"] and config["num_nextn_predict_layers"] == 2
    assert config["partial_rotary_factor"] == 0.5 and config["attention_bias"] and config["use_qk_norm"], config
    for flag in ("--add-qkv-bias", "--qk-layernorm", "--rotary-percent", "--moe-router-enable-expert-bias"):
        assert flag in entry["flags"], entry["flags"]


def test_deepseek_v3_imports_with_transformers_logits_and_exports_bit_for_bit(results):
    entry = part(results, "deepseek_v3")
    _round_trip(entry)
    config = entry["config"]
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 2
    assert config["first_k_dense_replace"] == 1 and config["n_group"] == 2 and config["routed_scaling_factor"] == 2.5
    for flag in ("--multi-latent-attention", "--moe-router-enable-expert-bias", "--rope-type"):
        assert flag in entry["flags"], entry["flags"]


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_next_layers"])
def test_qwen3_next_imports_with_transformers_logits_and_exports_bit_for_bit(results, name):
    entry = part(results, name)
    _round_trip(entry, SHIFTED[name])
    config, flags = entry["config"], entry["flags"]
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["partial_rotary_factor"] == 0.5, config
    for flag in ("--experimental-attention-variant", "--attention-output-gate", "--apply-layernorm-1p",
                 "--qk-layernorm", "--moe-shared-expert-gate", "--rotary-percent"):
        assert flag in flags, flags
    pattern = flags[flags.index("--linear-attention-freq") + 1]
    if name == "qwen3_next":
        assert pattern == "3" and config["full_attention_interval"] == 3, (pattern, config)
        # a published config.json: full_attention_interval and transformers' default rotary share
        assert entry["published config"] == {"layers": [1, 1, 0], "rotary_percent": 0.25}, entry["published config"]
        assert config["num_nextn_predict_layers"] == config["mtp_num_hidden_layers"] == 2, config
    else:  # no interval describes its layers: megatron-core's list pattern
        assert pattern == "[0,1,0]" and "full_attention_interval" not in config, (pattern, config)
        assert "--moe-router-pre-softmax" in flags and config["mlp_only_layers"] == [0], (flags, config)


def test_the_shifted_output_norm_exports_the_scale_the_model_computes_with(results):
    """Gated DeltaNet's output norm scales by w in transformers, by 1 + w' in megatron-core (w' = w - 1):
    a bf16 checkpoint (as published) comes back bit for bit; in fp32, w - 1 rounds below 0.5 (the test
    model has such values), and the export writes (w - 1) + 1, the scale the model computes with."""
    fp32 = part(results, "qwen3_next")
    assert fp32["differing"] == SHIFTED["qwen3_next"], fp32["differing"]  # the rounding is exercised
    bf16 = part(results, "qwen3_next_bf16")
    _round_trip(bf16)
    assert bf16["config"]["torch_dtype" if "torch_dtype" in bf16["config"] else "dtype"] == "bfloat16", bf16["config"]


@pytest.mark.parametrize("family, name", [("deepseek_v3", None), ("glm_4_5", None), ("qwen3_next", None),
                                          ("qwen3_5", "qwen3.5"), ("qwen3_5", "qwen3.5-moe")])
def test_mtp_depths_compute_the_engines_mtp_forward(results, family, name):
    depths = entry(results, family, name)
    assert depths["depths"] == 2, depths
    for depth in (1, 2):
        assert depths[f"depth {depth} logits"] <= PARITY, (depth, depths[f"depth {depth} logits"])


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_4_5"])
def test_mtp_layer_has_the_loaders_names(results, family):
    names = set(part(results, family)["mtp names"])
    from tests.bodies.bridges import DEEPSEEK_MTP, GQA, MLA

    attention = MLA if family == "deepseek_v3" else GQA
    assert set(DEEPSEEK_MTP) | set(attention) <= names, sorted(set(DEEPSEEK_MTP) | set(attention) - names)
    assert {"mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.3.down_proj.weight",
            "mlp.shared_experts.gate_proj.weight"} <= names, sorted(names)


@pytest.mark.parametrize("family, name", [("qwen3_next", None), ("qwen3_5", "qwen3.5-moe")])
def test_qwen3_next_mtp_layer_has_the_loaders_names(results, family, name):
    names = set(entry(results, family, name)["mtp names"])
    shared = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"}
    layer = {f"layers.{k}.{name}" for k in (0, 1) for name in (
        "self_attn.q_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight",
        "mlp.experts.3.down_proj.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert_gate.weight")}
    assert shared | layer <= names and not {n for n in names if n.startswith("embed") or "head" in n}, sorted(names)


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_qwen3_5_imports_with_transformers_logits_and_exports_bit_for_bit(results, name):
    model = entry(results, "qwen3_5", name)
    _round_trip(model, SHIFTED[name])
    config, flags = model["config"], model["flags"]
    architecture, model_type = {"qwen3.5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
                                "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}[name]
    assert config["architectures"] == [architecture] and config["model_type"] == model_type, config
    assert config["mtp_num_hidden_layers"] == 2 and "norm_topk_prob" not in config, config
    assert ("--moe-shared-expert-gate" in flags) == (name == "qwen3.5-moe"), flags
    assert flags[flags.index("--linear-attention-freq") + 1] == "3", flags


def test_qwen3_5_moe_exports_as_qwen3_next_on_request(results):
    """The trainer's arguments are the same for both; --architecture qwen3_next stores Qwen3-Next's form."""
    export = entry(results, "qwen3_5", "as qwen3_next")
    assert export["status"] == 0 and export["config"]["architectures"] == ["Qwen3NextForCausalLM"], export
    assert export["logits"] <= PARITY, export["logits"]


def test_the_qwen3_5_vlm_form_imports_its_language_model(results):
    vlm = part(results, "qwen3_5_vlm")
    assert vlm["transformers' logits"] <= PARITY, vlm  # the wrapped form is the one transformers loads
    assert vlm["import"][0] == 0 and vlm["same as text-only"] and vlm["logits"] <= PARITY, vlm
    assert "the vision tower (2 tensors) left out" in vlm["printed"], vlm["printed"]
    assert vlm["export"][0] == 0 and not vlm["names only one side"], vlm
    assert set(vlm["differing"]) <= set(SHIFTED["qwen3.5"]) and not vlm["differing at w >= 0.5"], vlm
    assert vlm["differing"] == vlm["differing as the model computes them"], vlm
    assert vlm["config"]["architectures"] == ["Qwen3_5ForCausalLM"], vlm["config"]


@pytest.mark.parametrize("family, case, words", [
    ("qwen3_5_vlm", "no text_config", "without a text_config"),
    ("qwen3_5_refusals", "attention biases", "attention_bias"),
    ("qwen3_5_refusals", "dense layers as qwen3_5_moe", "experts in every layer"),
    ("qwen3_5_refusals", "qwen3.5 as qwen3", "Qwen3_5ForCausalLM-shaped"),
    ("qwen3_5_refusals", "qwen3.5 as qwen3_next", "Qwen3_5ForCausalLM-shaped")])
def test_what_the_qwen3_5_bridge_cannot_carry_is_refused_in_one_line(results, family, case, words):
    refused = entry(results, family, case)
    assert refused["status"] == 2 and len(refused["stderr"]) == 1 and words in refused["stderr"][0], refused
    assert not refused["written"], refused


STACKED = ["qwen3-moe", "deepseek-v3", "glm-4.5", "qwen3-next", "qwen3.5-moe"]


@pytest.mark.parametrize("name", STACKED)
def test_stacked_experts_import_as_the_per_expert_checkpoint(results, name):
    """transformers' classes hold every MoE family's experts stacked (gate_up_proj [E, 2F, H], down_proj
    [E, H, F]) and read both layouts; so does the import, the MTP depths' experts stacked or not."""
    stacked = entry(results, "stacked_experts", name)
    assert stacked["stacked names"] and stacked["transformers' logits equal"], stacked
    for form in ("published", "all stacked"):
        imported = stacked[form]
        assert imported["import"][0] == 0, imported["import"]
        same = imported["as the per-expert import"]
        assert same["tensors"] and not same["names only one side"] and not same["differing"], same


@pytest.mark.parametrize("name", STACKED)
@pytest.mark.parametrize("export", ["default", "per_expert", "stacked"])
def test_stacked_experts_export_bit_for_bit_in_either_layout(results, name, export):
    """The all-stacked import written back per expert, stacked, and by default as the family's
    published checkpoints store them (Qwen3.5-MoE: decoder layers stacked, MTP depths per expert)."""
    written = entry(results, "stacked_experts", name)[f"export {export}"]
    assert written["export"][0] == 0 and not written["names only one side"], written
    shifted = SHIFTED["qwen3_next"] if name in ("qwen3-next", "qwen3.5-moe") else []  # (Gated DeltaNet's)
    assert set(written["differing"]) <= set(shifted), written
    assert written["differing"] == written["differing as the model computes them"], written


@pytest.mark.parametrize("case, words", [
    ("stack of another size", "down_proj has shape [3, 64, 32]"), ("both layouts", "both stacked"),
    ("gate_up_proj alone", "need both gate_up_proj and down_proj"), ("dense model", "has no experts")])
def test_stacked_experts_the_config_does_not_describe_are_refused_in_one_line(results, case, words):
    refused = entry(results, "stacked_refusals", case)
    assert refused["status"] == 2 and len(refused["stderr"]) == 1 and words in refused["stderr"][0], refused
    assert not refused["written"], refused


@pytest.mark.parametrize("case, words", [
    ("norm_topk_prob false", "norm_topk_prob false"), ("top-k over groups not 2", "topk_group 1 != 2"),
    ("rope not interleaved", "rope_interleave false"), ("yarn with another original context", "2048")])
def test_what_megatron_core_computes_otherwise_is_refused_in_one_line(results, case, words):
    entry = part(results, "refusals")[case]
    assert entry["status"] == 2 and len(entry["stderr"]) == 1 and words in entry["stderr"][0], entry
    assert entry["written"] is False, entry


@pytest.mark.parametrize("case, words", [
    ("mtp on a last Gated DeltaNet layer", "last layer is Gated DeltaNet"),
    ("value heads not grouped by key head", "linear_num_value_heads 3"), ("no shared expert", "shared expert"),
    ("attention biases", "attention_bias"), ("depths with their own fc", "--mtp-layout none"),
    ("another family's MTP layout", "--mtp-layout qwen3_next")])
def test_what_the_qwen3_next_bridge_cannot_carry_is_refused_in_one_line(results, case, words):
    entry = part(results, "qwen3_next_refusals")[case]
    assert entry["status"] == 2 and len(entry["stderr"]) == 1 and words in entry["stderr"][0], entry
    assert entry["written"] is False, entry


GDN_IMPORTS = ["qwen3-next-mg", "qwen3.5-mg", "qwen3.5-moe-mg"]


@pytest.mark.parametrize("name", GDN_IMPORTS)
def test_decoding_gated_delta_net_over_its_cached_state_equals_a_whole_sequence_recompute(results, name):
    """Greedy and Gumbel speculative decoding from the cached convolution inputs and recurrent
    states: the recompute's tokens and every draft's logits; rejection sampling's verify steps the
    whole-sequence forward's logits."""
    decoded = entry(results, "gdn_decoding", name)
    assert decoded["same"] and decoded["sampled same"] and decoded["draft calls"] > 0, decoded
    assert decoded["worst"] <= PARITY, decoded["worst"]
    rejection = decoded["rejection"]
    assert rejection["tokens"] == 16 and rejection["verify steps"] > 0 and rejection["worst"] <= PARITY, rejection


@pytest.mark.parametrize("name", GDN_IMPORTS)
def test_gated_delta_net_work_per_step_does_not_grow_with_the_prefix(results, name):
    """After the prefill each verify step runs its 1 + D positions through each Gated DeltaNet
    layer, after a prompt of 4 tokens as after one of 40; the recompute runs the whole sequence."""
    decoded = entry(results, "gdn_decoding", name)
    layers, depths = decoded["gated delta net layers"], 2
    for length, work in decoded["work"].items():
        assert work["cached"] and all(positions == 1 + depths and ran == positions * layers
                                      for positions, ran in work["cached"]), (length, work)
        assert min(work["recomputed"]) >= int(length) * layers, (length, work)


def test_eval_speculative_decodes_gated_delta_net(results):
    run = entry(results, "gdn_decoding", "eval_speculative")
    assert run["status"] == 0, run


def test_decoding_mla_over_the_kv_cache_equals_a_whole_sequence_recompute(results):
    entry = part(results, "mla_decoding")
    assert entry["same"] and entry["sampled same"] and entry["draft calls"] > 0, entry
    assert entry["worst"] <= PARITY, entry["worst"]
    assert entry["eval_speculative"]["status"] == 0, entry["eval_speculative"]


@pytest.mark.slow
@pytest.mark.parametrize("family, name, ranks, layout", [
    pytest.param("deepseek_v3", "deepseek-v3", 2, ("--expert-model-parallel-size", "2"), marks=pytest.mark.matrix),
    ("qwen3_next", "qwen3-next", 1, ()), ("qwen3_5", "qwen3.5", 1, ())])
def test_the_trainer_trains_heads_on_the_import_with_its_backbone_frozen(results, family, name, ranks, layout):
    part(results, family)
    imported = results["root"] / f"{name}-mg"
    trained = results["root"] / f"{name}-trained"
    flags = (imported / "megatron_flags.txt").read_text().split()
    run = train(ranks, *TINY, *flags, "--load", str(imported), "--finetune", "--freeze-backbone", "--mtp-detach-heads",
                *layout, "--train-iters", "2", "--lr", "3e-3", "--save", str(trained), "--save-interval", "2",
                timeout=400)
    assert sorted(run.iterations) == [1, 2] and "mtp_2 loss" in run.iterations[2], run.tail()
    compared = launch("tests.bodies.bridges:frozen", 1, {"imported": str(imported), "trained": str(trained)},
                      timeout=300)[0]
    assert compared["backbone"] and not compared["backbone changed"], compared
    assert compared["mtp changed"], compared
    # the trained checkpoint (the trainer's own arguments) decodes over its cache as the recompute does
    decoded = launch("tests.bodies.serving:kv_cache", 1, {"root": str(results["root"]), "names": [f"{name}-trained"],
                                                          "lengths": [1, 19], "new_tokens": 16}, timeout=600)[0]
    decoded = decoded[f"{name}-trained"]
    assert decoded["same"] and decoded["sampled same"] and decoded["worst"] <= PARITY, decoded
