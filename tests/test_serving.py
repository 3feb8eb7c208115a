# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""From training to serving: tools/convert_checkpoint.py and tools/eval_speculative.py.

One module-scoped pipeline, so megatron-core is imported in few processes:
1. tiny random Llama (tied, Llama 3 RoPE scaling) and Qwen2 (untied, QKV biases, one MiMo MTP
   depth) checkpoints written by `transformers`, and two constructed Qwen2 "counting" models,
   imported (the Qwen2 one with a second, new MTP depth);
2. pretrain_gpt_mtp.py --load the imported Qwen2 --finetune --freeze-backbone --mtp-detach-heads
   at TP = 2 x PP = 2 (D = 2), 4 iterations;
3. one process checks: parity with transformers and with plain-PyTorch MiMo / DeepSeek-V3 MTP
   forwards, the loaders' tensor names, round trips, the frozen backbone, speculative decoding
   (constructed models; the KV cache against a whole-sequence recompute), eval_speculative.py,
   MiMo's config, an import that fails after writing. Each part reports its own result or its
   own traceback, so a test fails with the error of the part it reads.
A repeated MTP layer (issue 17): its own short run (pretrain_gpt_mtp.py --mtp-use-repeated-layer,
D = 2, a Qwen2-shaped model from scratch, one rank) and one process that exports, re-imports and
runs it.
Bad input runs the command line, one subprocess per case.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_mtp.serving import speculative
from megatron_mtp.serving.config import ModelConfig
from tests.harness.launcher import REPO_ROOT, launch
from tests.harness.trainer import TINY, example_flags, train

PARITY = 1e-5  # relative, fp32
KV_CACHE = 1e-5  # relative, a draft's logits over the cache against the recompute (measured <= 5e-7)
HYBRID_PATTERN = "G-*G-/G*-/G*-"  # Gated DeltaNet, attention and MLP layers; two MTP depths, each with its own
HYBRID = ("--hybrid-layer-pattern", HYBRID_PATTERN, "--swiglu", "--normalization", "RMSNorm", "--linear-num-key-heads",
          "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16",
          "--linear-conv-kernel-dim", "4")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    prepared = launch("tests.bodies.serving:prepare", 1, {"root": str(root)}, timeout=300)[0]
    # the import's own flags at the tensor-parallel size it was made for (no vocabulary override)
    train(4, *TINY, *prepared["flags"], "--load", str(root / "qwen-mg"), "--finetune", "--freeze-backbone",
          "--mtp-detach-heads", "--mtp-num-layers", "2", "--tensor-model-parallel-size", "2",
          "--pipeline-model-parallel-size", "2", "--train-iters", "4",
          "--lr", "3e-3", "--save", str(root / "trained"), "--save-interval", "4", timeout=400)
    # an MoE checkpoint (D = 1) with Qwen3-Next's attention (an output gate, q/k norms, zero-centred norms),
    # which eval_speculative.py runs over its KV cache, and a HybridModel one with Gated DeltaNet layers in
    # the decoder and in each MTP depth, which it runs over the same cache (export refuses it)
    train(1, *TINY, "--num-experts", "2", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
          "--disable-bias-linear", "--attention-output-gate", "--qk-layernorm", "--normalization", "RMSNorm",
          "--apply-layernorm-1p", "--mtp-num-layers", "1", "--train-iters", "1", "--save", str(root / "trained-moe"),
          "--save-interval", "1", timeout=300)
    # (one iteration: its drafts are often rejected, so decoding continues from earlier states)
    train(1, *TINY, *HYBRID, "--train-iters", "1", "--lr", "3e-3", "--save", str(root / "trained-hybrid"),
          "--save-interval", "1", timeout=300)
    results = launch("tests.bodies.serving:check", 1, {"root": str(root)}, timeout=600)[0]
    return root, {**results, "prepared": prepared}


def part(pipeline, name: str):
    """One part of the check body's results; its own traceback if that part failed."""
    result = pipeline[1][name]
    if isinstance(result, dict) and set(result) == {"error"}:
        pytest.fail(f"{name}:\n{result['error']}", pytrace=False)
    return result


def test_imported_models_compute_what_transformers_computes(pipeline):
    parity = part(pipeline, "parity")
    for name in ("llama logits", "qwen logits", "mimo backbone logits", "deepseek_v3 backbone logits"):
        assert parity[name] <= PARITY, (name, parity[name])


def test_exported_mtp_depths_compute_mimo_and_deepseek_mtp_forwards(pipeline):
    parity = part(pipeline, "parity")
    for layout in ("mimo", "deepseek_v3"):
        for depth in (1, 2):
            assert parity[f"{layout} depth {depth} logits"] <= PARITY, (layout, depth, parity)


def test_the_second_depth_served_otherwise_than_trained_computes_other_logits(pipeline):
    """What export warns of (docs/serving.md "What the engines run"): megatron-core trains depth 2 on
    depth 1's normalized output with its own layer; an engine carrying the pre-norm state, or running
    the first depth's layer at every step, computes depth 2's logits otherwise on the trained model."""
    parity = part(pipeline, "parity")
    for layout in ("mimo", "deepseek_v3"):
        for served in ("pre-norm state carried", "the first depth's layer again"):
            assert parity[f"{layout} depth 2 logits, {served}"] > 100 * PARITY, (layout, served, parity)


def test_exported_names_are_the_loaders(pipeline):
    assert set(part(pipeline, "names")) == {"mimo", "deepseek_v3"}


def test_round_trips_are_bit_identical(pipeline):
    root, _ = pipeline
    trips = part(pipeline, "round trips")
    assert trips["qwen import-export tensors"] > 0 and trips["llama import-export tensors"] > 0
    assert trips["mimo export-import tensors"] == trips["deepseek_v3 export-import tensors"] > 0
    config = json.loads((root / "export-mimo" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_nextn_predict_layers"] == 2
    assert not [p.name for p in root.iterdir() if ".partial-" in p.name]  # staging renamed or removed


def test_the_import_s_flags_build_the_imported_model_at_its_tensor_parallel_size(pipeline):
    """The flags the trainer ran with above: the model's shape, the vocabulary padded as the trainer
    pads it at TP = 2 (Megatron's default of 128 x TP; before, 128 alone, and the trainer refused the
    checkpoint at TP = 2), and Qwen2's dropout (none) instead of Megatron's default 0.1."""
    root, _ = pipeline
    flags = (root / "qwen-mg" / "megatron_flags.txt").read_text().split()
    assert "--add-qkv-bias" in flags and "--untie-embeddings-and-output-weights" in flags
    assert flags[flags.index("--make-vocab-size-divisible-by") + 1] == "128"
    assert flags[flags.index("--attention-dropout") + 1] == "0" and flags[flags.index("--hidden-dropout") + 1] == "0"
    assert pipeline[1]["prepared"]["qwen-mg vocabulary"] == [257, 512]  # 257 padded to a multiple of 256


def test_trainer_loads_the_import_at_tp2_pp2_with_the_backbone_frozen(pipeline):
    frozen = part(pipeline, "frozen backbone")
    assert frozen["backbone tensors"] > 0 and frozen["mtp tensors changed"] > 0


def test_speculative_decoding_constructed_models(pipeline):
    cases = part(pipeline, "speculative")
    perfect, wrong = cases["counting"], cases["counting-wrong"]
    assert perfect["acceptance per depth (vLLM per-position rate)"] == [1.0, 1.0]
    assert perfect["draft acceptance rate"] == 1.0
    assert perfect["mean acceptance length incl. bonus"] == 3.0
    assert perfect["teacher-forced acceptance per depth"] == [1.0, 1.0]
    assert perfect["target forwards per generated token"] < 0.5
    assert wrong["acceptance per depth (vLLM per-position rate)"] == [0.0, 0.0]
    assert wrong["mean acceptance length incl. bonus"] == 1.0
    assert wrong["target forwards per generated token"] == 1.0


def test_decoding_over_the_kv_cache_equals_a_whole_sequence_recompute(pipeline):
    for name, result in part(pipeline, "kv cache").items():
        assert result["same"] and result["draft calls"] > 0, (name, result)
        assert result["worst"] <= KV_CACHE, (name, result)
        # Sampling (GumbelSampler): speculative = plain sampling, token for token; drafts were accepted.
        assert result["sampled same"], (name, result)
    assert part(pipeline, "kv cache")["trained"]["sampled accepted"] > 0


def test_a_hybridmodel_decodes_its_gated_delta_net_and_attention_over_the_cache_as_the_recompute(pipeline):
    """The HybridModel checkpoint (HYBRID_PATTERN), its attention layers over the KV cache and its
    Gated DeltaNet layers over their cached convolution inputs and recurrent states, in the decoder
    and in each MTP depth: greedy and Gumbel speculative decoding give the whole-sequence
    recompute's tokens and every draft's logits, drafts accepted; rejection sampling's verify steps
    the whole-sequence forward's logits."""
    decoded = part(pipeline, "hybrid")
    assert decoded["same"] and decoded["sampled same"] and decoded["draft calls"] > 0, decoded
    assert decoded["sampled accepted"] > 0 and decoded["worst"] <= KV_CACHE, decoded
    rejection = decoded["rejection"]
    assert rejection["tokens"] == 16 and rejection["verify steps"] > 0 and rejection["worst"] <= KV_CACHE, rejection


def test_a_hybridmodel_s_gated_delta_net_work_per_step_does_not_grow_with_the_prefix(pipeline):
    """After the prefill each verify step runs its 1 + D positions through each of the decoder's
    Gated DeltaNet layers, after a prompt of 4 tokens as after one of 40; the recompute runs the
    whole sequence."""
    work, layers, depths = part(pipeline, "hybrid")["work"], HYBRID_PATTERN.split("/")[0].count("G"), 2
    for length, counted in work.items():
        assert counted["cached"] and all(positions == 1 + depths and ran == positions * layers
                                         for positions, ran in counted["cached"]), (length, counted)
        assert min(counted["recomputed"]) >= int(length) * layers, (length, counted)


def test_eval_speculative_runs_a_hybridmodel_and_refuses_mamba_layers_in_one_line(pipeline):
    decoded = part(pipeline, "hybrid")
    greedy, rejection = decoded["eval_speculative greedy"], decoded["eval_speculative rejection"]
    assert greedy["status"] == 0 and "lossless: True" in greedy["stdout"], greedy
    assert rejection["status"] == 0 and "verify steps:" in rejection["stdout"], rejection
    refusal = decoded["mamba refusal"]
    assert "\n" not in refusal and "(--hybrid-layer-pattern M*M-/*-) has layers M" in refusal, refusal


def test_rejection_sampling_on_a_trained_checkpoint_is_lossless_in_distribution(pipeline):
    """tests/bodies/serving.py:rejection: the second and third tokens of 1,000 decodes at temperature
    0.4 pass a chi-square test of uniformity of their probability integral transform under the plain
    model's p (10 bins, level 0.005 each) whose power against each broken verifier (recovery from p:
    a statistic of 64 when broken on purpose; acceptance with probability p(d): 1,019) is >= 0.99."""
    result = part(pipeline, "rejection")
    assert all(power >= 0.99 for power in result["power"].values()), result["power"]
    assert result["token 2"] <= result["threshold"] and result["token 3"] <= result["threshold"], result
    assert 0.0 < result["acceptance"]["draft acceptance rate"] < 1.0, result["acceptance"]


class ScriptedRunner:
    """A runner whose main head counts (greedy token after x: x + 1 mod 10) and whose depth k drafts
    `drafts[k](x)` from its input token x = x_{t+k}; hidden states are placeholders."""

    def __init__(self, depth_drafts):
        self.depth_drafts, self.depths = depth_drafts, len(depth_drafts)

    @staticmethod
    def _logits(next_tokens):
        return torch.nn.functional.one_hot(torch.tensor(next_tokens), 10).float().unsqueeze(0)

    def main(self, tokens, start=0):
        ids = tokens[0].tolist()
        return torch.zeros(len(ids), 1, 1), self._logits([(x + 1) % 10 for x in ids])

    def depth(self, k, hidden, ahead, start=0):
        ids = ahead[0].tolist()
        return torch.zeros(len(ids), 1, 1), self._logits([self.depth_drafts[k - 1](x) % 10 for x in ids])


def test_the_acceptance_counters_on_a_hand_computed_case():
    """D = 2, depth 1 always right (x + 1), depth 2 always wrong (x + 2 where x + 1 is due), 10 new
    tokens after the prompt [0]: the prefill emits 1; every verify step accepts d_1, rejects d_2 and
    adds the bonus (2 tokens), so 4 verify steps bring 9 tokens and the fifth the 10th (its d_1; the
    bonus beyond the 10 asked for is neither emitted nor counted): 10 tokens in 6 target forwards,
    acceptance per position [5/5, 0/5], draft acceptance 5 / 10, mean acceptance length 1 + 5/5 = 2,
    6/10 target forwards per generated token."""
    stats = speculative.Stats(depths=2)
    output = speculative.speculative(ScriptedRunner([lambda x: x + 1, lambda x: x + 2]), [0], 10, stats)
    assert output == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert (stats.drafts, stats.accepted_per_position, stats.forwards, stats.generated) == (5, [5, 0], 6, 10)
    summary = stats.summary()
    assert summary["acceptance per depth (vLLM per-position rate)"] == [1.0, 0.0]
    assert summary["draft acceptance rate"] == 0.5
    assert summary["mean acceptance length incl. bonus"] == 2.0
    assert summary["target forwards per generated token"] == 6 / 10


def test_a_sampled_draft_that_is_the_main_head_s_token_is_accepted():
    """GumbelSampler: every depth of this runner gives, from its input token x_{t+k}, the main head's
    logits after that token, so a draft of x_{t+k+1} drawn with position t+k+1's noise, the noise
    the verifier draws there, is the verifier's token: all drafts are accepted, whatever was
    sampled. A draft drawn with another position's noise matches about one time in eight (the
    one-hot logits give the favoured token 0.23 at temperature 1); the outputs alone, equal to
    plain sampling either way, cannot tell."""
    runner = ScriptedRunner([lambda x: x + 1] * 3)
    sampler = speculative.GumbelSampler(seed=1, sequence=0)
    stats = speculative.Stats(depths=3)
    output = speculative.speculative(runner, [0], 24, stats, choose=sampler)
    assert output == speculative.greedy(runner, [0], 24, choose=sampler)
    assert output != speculative.greedy(runner, [0], 24)  # sampled: the noise moved tokens off the argmax
    assert stats.drafts > 0 and stats.summary()["draft acceptance rate"] == 1.0, stats


def test_eval_speculative_on_a_trained_checkpoint_is_lossless(pipeline):
    runs = part(pipeline, "evaluate")
    run = runs["all depths"]
    assert run["status"] == 0, run["stderr"]
    summary = run["results"]
    assert summary["lossless"] and summary["prompts"] == 4
    assert "prompt 4/4 done (" in run["stderr"] and ", ETA 00:00:00)" in run["stderr"]  # progress on stderr
    per_depth = summary["acceptance per depth (vLLM per-position rate)"]
    assert len(per_depth) == 2 and all(0.0 <= rate <= 1.0 for rate in per_depth)
    assert per_depth[1] <= per_depth[0]  # position 2 is accepted only after position 1
    assert 1.0 <= summary["mean acceptance length incl. bonus"] <= 3.0
    assert 1 / 3 <= summary["target forwards per generated token"] <= 1.0
    assert all(0.0 <= rate <= 1.0 for rate in summary["teacher-forced acceptance per depth"])


def test_eval_speculative_runs_an_moe_checkpoint(pipeline):
    """MoE layers as the trainer builds them on CPU (it ended in a traceback)."""
    run = part(pipeline, "evaluate")["moe"]
    assert run["status"] == 0, run["stderr"]
    assert run["results"]["lossless"] and run["results"]["depths"] == 1, run["results"]


def test_eval_speculative_drafts_with_fewer_depths_than_trained(pipeline):
    """--depths 1 on a D = 2 checkpoint (it ended in an IndexError: the teacher-forced counters were
    sized to 1 depth, every depth was run)."""
    run = part(pipeline, "evaluate")["depth 1"]
    assert run["status"] == 0, run["stderr"]
    summary = run["results"]
    assert summary["depths"] == 1 and summary["lossless"]
    assert len(summary["acceptance per depth (vLLM per-position rate)"]) == 1
    assert len(summary["teacher-forced acceptance per depth"]) == 1


def test_eval_speculative_samples_with_the_rejection_sampler_and_reports_vllm_s_counts(pipeline):
    """--sampler rejection --temperature 0.7: vLLM's per-position rates, the conditional rates (accepted
    at depth k / steps that reached depth k), the mean acceptance length, and beside them the
    teacher-forced sampled acceptance (spec section 12) on the same texts and at the positions the decode
    drafted at, the conditional acceptance within 4 standard errors of the latter; lossless is not
    claimed token for token (null).
    --sampler gumbel at the same temperature is checked token for token against plain sampling."""
    run = part(pipeline, "evaluate")["rejection"]
    assert run["status"] == 0, run["stderr"]
    summary = run["results"]
    assert summary["sampler"] == "rejection" and summary["temperature"] == 0.7 and summary["lossless"] is None
    per_position = summary["acceptance per depth (vLLM per-position rate)"]
    conditional = summary["conditional acceptance per depth"]
    assert len(per_position) == len(conditional) == 2 and 0.0 < per_position[1] <= per_position[0] < 1.0, summary
    assert conditional[0] == per_position[0] and conditional[1] == pytest.approx(per_position[1] / per_position[0])
    assert summary["mean acceptance length incl. bonus"] == pytest.approx(1 + sum(per_position))
    assert all(0.0 < a < 1.0 for a in summary["teacher-forced sampled acceptance per depth"]), summary
    # the live conditional acceptance against the teacher-forced sampled acceptance where it drafted
    # (speculative.drafted_acceptance), 16 prompts, about 150 verify steps: measured z 0.6 and -0.5.
    # Here sum min(p, q) is about 0.87 wherever the decode drafts, so this checks the command end to
    # end (a q at half the temperature gives z 2.9, inside the bound); the comparison's power against
    # wrong positions, temperatures and rules is tests/test_rejection_sampling.py's
    assert all(0.0 < a < 1.0 for a in summary["expected conditional acceptance per depth"]), summary
    assert all(abs(z) <= 4 for z in summary["conditional acceptance z per depth"]), summary
    gumbel = part(pipeline, "evaluate")["gumbel"]
    assert gumbel["status"] == 0 and gumbel["results"]["lossless"] is True, gumbel


def test_eval_speculative_reports_both_draft_modes_and_verifies_greedy_drafts(pipeline):
    """Both engine modes' teacher-forced predictions (spec section 12.1), whichever mode decodes: the
    greedy-draft acceptance p(argmax q) and the sampled sum_v min(p, q) per depth, and each mode's
    expected accepted length 1 + sum_j mean_t prod_{i<=j}; with --draft-sample-method greedy (vLLM's
    default) the live conditional acceptance within 4 standard errors of the teacher-forced
    p(argmax q) at the drafted positions. With greedy decoding the greedy-draft acceptance is
    whether argmax q is the main head's argmax, and the sampled one is not measured.
    This checkpoint's softmaxes are near uniform (4 iterations): measured sum_v min(p, q) 0.87 at
    both depths, p(argmax q) 0.0038 (about 1 / V), expected accepted lengths 2.62 (sampling) and
    1.004 (greedy drafts); live, greedy drafts were accepted at 0.005 (so depth 2 is rarely reached
    and the live check is depth 1's). Seen failing with the greedy decode compared against
    sum_v min(p, q) (the tool not passing its mode on): z -48.5 at depth 1."""
    runs = part(pipeline, "evaluate")
    for name in ("rejection", "rejection greedy drafts"):
        summary = runs[name]["results"]
        greedy = summary["teacher-forced greedy-draft acceptance per depth"]
        sampled = summary["teacher-forced sampled acceptance per depth"]
        assert len(greedy) == len(sampled) == 2 and all(0.0 < b < 1.0 for b in greedy + sampled), summary
        for mode, per_depth in (("greedy drafts", greedy), ("sampling", sampled)):
            # the chain's product lies below the per-depth values' sum: 1 < length < 1 + sum
            length = summary[f"teacher-forced expected accepted length ({mode})"]
            assert 1.0 + per_depth[0] <= length < 1.0 + sum(per_depth), (mode, summary)
    greedy_drafts = runs["rejection greedy drafts"]
    assert greedy_drafts["status"] == 0, greedy_drafts["stderr"]
    summary = greedy_drafts["results"]
    assert summary["draft sample method"] == "greedy" and runs["rejection"]["results"]["draft sample method"] == \
        "probabilistic"
    assert all(0.0 < a < 1.0 for a in summary["expected conditional acceptance per depth"]), summary
    assert all(abs(z) <= 4 for z in summary["conditional acceptance z per depth"]), summary
    plain = runs["all depths"]["results"]
    assert plain["teacher-forced sampled acceptance per depth"] == [None, None], plain
    assert all(0.0 <= b <= 1.0 for b in plain["teacher-forced greedy-draft acceptance per depth"]), plain
    assert plain["teacher-forced expected accepted length (sampling)"] is None, plain


def test_eval_speculative_refuses_a_temperature_it_cannot_use_in_one_line(pipeline):
    refusals = part(pipeline, "eval refusals")
    for name, words in (("greedy temperature", "--temperature applies to --sampler gumbel or rejection"),
                        ("zero temperature", "--temperature 0.0 must be > 0"),
                        ("draft mode without rejection", "--draft-sample-method applies to --sampler rejection")):
        refusal = refusals[name]
        assert refusal["status"] == 2 and len(refusal["stderr"]) == 1, (name, refusal)
        assert refusal["stderr"][0].startswith("eval_speculative.py: error: ") and words in refusal["stderr"][0]


def test_eval_speculative_encodes_prompts_with_the_checkpoint_s_tokenizer(pipeline):
    run = part(pipeline, "evaluate")["prompts file"]
    assert run["status"] == 0 and "lossless: True" in run["stdout"], run


def test_eval_speculative_refuses_bad_input_in_one_line(pipeline):
    expected = {"missing prompts": "--prompts", "bad tokenizer": "--tokenizer",
                "tokenizer without prompts": "--tokenizer encodes --prompts"}
    refusals = part(pipeline, "eval refusals")
    for name, words in expected.items():
        refusal = refusals[name]
        assert refusal["status"] == 2 and len(refusal["stderr"]) == 1, (name, refusal)
        line = refusal["stderr"][0]
        assert line.startswith("eval_speculative.py: error: ") and words in line, (name, line)


def test_a_mimo_checkpoint_imports_and_exports_as_mimo(pipeline):
    mimo = part(pipeline, "mimo")
    assert mimo["import"] == 0 and mimo["same as qwen2's import"], mimo
    assert mimo["export"] == 0 and mimo["round trip"], mimo
    # model_type qwen2: transformers (and vLLM, which reads config.json through it) knows no `mimo`
    assert mimo["exported config"] == [["MiMoForCausalLM"], "qwen2", 1], mimo
    assert mimo["transformers loads the export"] == ["Qwen2ForCausalLM", 0.0], mimo
    assert mimo["trained as mimo"] == 0 and mimo["trained config"] == [["MiMoForCausalLM"], "qwen2", 2], mimo
    for name, words in (("llama as mimo", "QKV biases"), ("mimo in deepseek layout", "--architecture qwen2")):
        refusal = mimo["refusals"][name]
        assert refusal["status"] == 2 and len(refusal["stderr"]) == 1 and words in refusal["stderr"][0], refusal
        assert not refusal["written"], refusal


def test_a_qwen3_checkpoint_imports_with_its_qk_norms_and_exports_as_qwen3(pipeline):
    # before: "unknown architecture ['Qwen3ForCausalLM']"; q_norm / k_norm have no Llama / Qwen2 name
    result = part(pipeline, "qwen3")
    assert result["import"] == 0 and result["export"] == 0, result
    assert "--qk-layernorm" in result["flags"] and "--add-qkv-bias" not in result["flags"]
    assert result["logits"] <= PARITY, result["logits"]
    assert result["exported config"] == [["Qwen3ForCausalLM"], "qwen3", 24]
    assert result["round trip"] is True
    assert result["export's logits"] <= PARITY, result["export's logits"]


def test_an_import_that_fails_after_writing_leaves_nothing(pipeline):
    """The check that every backbone tensor was imported ran after the rename: a failing import left
    its output in place. Now it runs inside the staging directory."""
    result = part(pipeline, "staging")
    assert result["status"] == 2 and len(result["stderr"]) == 1, result
    assert "backbone parameter decoder.final_layernorm.weight was not imported" in result["stderr"][0], result
    assert not result["written"], result


def test_a_null_tokenizer_s_end_of_document_row_is_exported():
    """Megatron-LM's NullTokenizer convention: ids 0 .. vocab_size - 1 and the end of document at
    vocab_size, one more row than --vocab-size says; export keeps it (it wrote vocab_size rows)."""
    args = argparse.Namespace(
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
        num_attention_heads=4, group_query_attention=False, hidden_size=64, ffn_hidden_size=96, num_layers=2,
        kv_channels=16, max_position_embeddings=64, untie_embeddings_and_output_weights=True,
        tokenizer_type="NullTokenizer", vocab_size=256, null_tokenizer_eod_id=256, padded_vocab_size=384)
    config = ModelConfig.from_megatron_args(args)
    assert config.vocab_size == 257 and config.extra == {"eos_token_id": 256}
    args.null_tokenizer_eod_id = 255  # inside the ids: nothing added
    assert ModelConfig.from_megatron_args(args).vocab_size == 256


# ---------------------------------------------------------------- a repeated MTP layer

# The Qwen2 shape of the imported models (tests/bodies/serving.py), trained from scratch here; the
# vocabulary unpadded (257), so that every tensor, the embedding's and the output layer's too,
# survives export (which drops padded rows) and import (which pads with zero rows).
QWEN2_FLAGS = ("--ffn-hidden-size", "96", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
               "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--rotary-base", "1000000", "--add-qkv-bias",
               "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by", "1")
LAYOUTS = ("mimo", "deepseek_v3")


@pytest.fixture(scope="module")
def repeated(tmp_path_factory):
    """A checkpoint trained with --mtp-use-repeated-layer at D = 2 (one rank, 2 iterations), and
    what tests.bodies.serving:repeated_layer finds when it exports, re-imports and runs it."""
    root = tmp_path_factory.mktemp("serving-repeated")
    train(1, *TINY, *QWEN2_FLAGS, "--mtp-num-layers", "2", "--mtp-use-repeated-layer", "--train-iters", "2",
          "--lr", "3e-3", "--save", str(root / "trained-repeated"), "--save-interval", "2", timeout=300)
    return root, launch("tests.bodies.serving:repeated_layer", 1, {"root": str(root)}, timeout=400)[0]


def check_repeated_export(export: dict, dtype: str) -> None:
    """One layer trained at every depth is written once per depth (num_nextn_predict_layers = D), the
    copies bit-identical; each copy, run as MiMo's / DeepSeek-V3's MTP forward on the exported tensors,
    computes the logits of the model the export holds at its depth; import with
    --mtp-use-repeated-layer gives back that model's tensors and names, bit for bit."""
    assert export["status"] == 0, export
    assert export["num_nextn_predict_layers"] == 2, export
    assert "the one repeated layer written 2 times, identical" in export["said"], export["said"]
    assert export["depth tensors"][0] == export["depth tensors"][1] > 0 == export["depth tensors"][2], export
    assert export["depths differ in"] == [], export["depths differ in"]
    trip = export["round trip"]
    assert trip["status"] == 0 and trip["tensors"] > 0, trip
    assert trip["names only before"] == trip["names only after"] == [], trip
    assert trip["differing"] == [], trip["differing"][:5]
    assert trip["args"] == [2, True], trip["args"]
    flags = trip["flags"]
    assert "--mtp-use-repeated-layer" in flags and flags[flags.index("--mtp-num-layers") + 1] == "2", flags
    assert sorted(export["parity"]) == ["backbone logits", "depth 1 logits", "depth 2 logits"], export["parity"]
    for name, value in export["parity"].items():
        assert value <= PARITY, (dtype, name, export["parity"])


def test_a_repeated_mtp_layer_trains_as_one_layer_run_at_every_depth(repeated):
    _, results = repeated
    assert results["runner"] == {"repeated": True, "depths": 2}, results["runner"]
    assert results["trained mtp layers"] == ["mtp.layers.0"]  # the checkpoint holds the one layer


def test_a_repeated_mtp_layer_exports_in_bf16_as_identical_depths_and_round_trips(repeated):
    """bf16: the exported model is the trained one rounded, so logits are compared with its re-import
    (the trained tensors rounded to bf16, checked bit for bit)."""
    _, results = repeated
    for layout in LAYOUTS:
        check_repeated_export(results["bf16"][layout], "bf16")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_repeated_mtp_layer_exports_in_fp32_as_identical_depths_and_round_trips(repeated, layout):
    """fp32 (the default): the exported depths compute the trained model's logits, and the round trip
    gives back the trained checkpoint's tensors, bit for bit."""
    _, results = repeated
    check_repeated_export(results["fp32"][layout], "fp32")


def test_a_repeated_layer_export_imports_as_distinct_layers_without_the_flag(repeated):
    _, results = repeated
    distinct = results["distinct import"]
    assert distinct["status"] == 0 and distinct["args"] == [2, False], distinct
    assert distinct["layers"] == ["mtp.layers.0", "mtp.layers.1"] and distinct["differing"] == [], distinct


def test_differing_depths_imported_as_one_repeated_layer_are_refused_in_one_line(repeated):
    """An export whose second depth differs from its first in one tensor: --mtp-use-repeated-layer is
    refused in one line naming the tensor and the alternative, and nothing is written."""
    _, results = repeated
    refusal = results["differing depths"]
    assert refusal["status"] == 2 and len(refusal["stderr"]) == 1, refusal
    line = refusal["stderr"][0]
    assert line.startswith("convert_checkpoint.py: error: --mtp-use-repeated-layer: MTP depth 1 differs from "
                           "depth 0 (mtp_model_layer.mlp.linear_fc1.weight)"), line
    assert line.endswith("import the depths as distinct layers"), line
    assert not refusal["written"], refusal


# ---------------------------------------------------------------- bad input

def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_checkpoint.py"), *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def refused(run: subprocess.CompletedProcess, words: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("convert_checkpoint.py: error: ") and words in lines[0], lines


def damaged(pipeline, tmp_path, name: str, edit) -> Path:
    """A copy of the imported Qwen2 Hugging Face checkpoint, changed by `edit(config, tensors)`."""
    from safetensors.torch import load_file, save_file

    root, _ = pipeline
    config = json.loads((root / "qwen" / "config.json").read_text())
    tensors = load_file(str(root / "qwen" / "model.safetensors"))
    edit(config, tensors)
    target = tmp_path / name
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_bad_input_is_one_line_and_writes_nothing(pipeline, tmp_path):
    root, _ = pipeline

    def architecture(config, tensors):
        config["architectures"] = ["GPT2LMHeadModel"]

    def missing(config, tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]

    def misnamed(config, tensors):
        tensors["model.layers.1.mlp.upproj.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")

    def shape(config, tensors):
        config["intermediate_size"] = 128

    cases = {"architecture": (architecture, "unknown architecture"),
             "missing": (missing, "missing tensor model.layers.1.mlp.up_proj.weight"),
             "misnamed": (misnamed, "model.layers.1.mlp.upproj.weight"),
             "shape": (shape, "config.json implies")}
    for name, (edit, words) in cases.items():
        source = damaged(pipeline, tmp_path, name, edit)
        out = tmp_path / f"out-{name}"
        refused(cli("import", str(source), str(out)), words)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name], name

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    refused(cli("export", str(root / "trained"), str(busy)), "already holds files")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]

    out = tmp_path / "out-no-mtp"
    refused(cli("export", str(root / "llama-mg"), str(out), "--mtp-layout", "mimo"), "has no MTP depths")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_gumbel_sampling_draws_from_the_softmax_by_position_and_drafts_change_no_token():
    """GumbelSampler: token frequencies over many keys follow softmax(logits / T) (4,000 draws:
    standard error 0.007, tolerance 0.03); a position's token depends on its key and logits alone,
    so speculative decoding returns plain sampling's tokens whether drafts are right or wrong."""
    logits = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0))), -30.0]])  # p = 1/4, 3/4, ~0
    for temperature, expected in ((1.0, 0.75), (2.0, 3 ** 0.5 / (1 + 3 ** 0.5))):
        draws = [speculative.GumbelSampler(seed=1, sequence=s, temperature=temperature)(logits, 5)[0]
                 for s in range(4000)]
        assert abs(draws.count(1) / 4000 - expected) < 0.03 and draws.count(2) == 0, (temperature, draws.count(1))
    sampler = speculative.GumbelSampler(seed=1, sequence=0)
    assert sampler(logits.repeat(3, 1), 7)[1] == sampler(logits, 8)[0]  # the row at position 8, either way
    assert set(sampler(logits.repeat(200, 1), 0)) == {0, 1}  # each position draws noise of its own

    class NoisyMain(ScriptedRunner):  # main head: +1 or +2 (equally likely), so sampling matters
        def main(self, tokens, start=0):
            ids = tokens[0].tolist()
            logits = self._logits([(x + 1) % 10 for x in ids]) + self._logits([(x + 2) % 10 for x in ids])
            return torch.zeros(len(ids), 1, 1), logits * 20

    for drafts in ([lambda x: x + 1, lambda x: x + 2], [lambda x: x + 2, lambda x: x + 4], [lambda x: x + 5]):
        runner = NoisyMain(drafts)
        for sequence in range(5):
            choose = speculative.GumbelSampler(seed=3, sequence=sequence)
            stats = speculative.Stats(depths=runner.depths)
            output = speculative.speculative(runner, [0], 12, stats, choose=choose)
            assert output == speculative.greedy(runner, [0], 12, choose=choose), (drafts, sequence)
            # ending at a stop token: the same tokens up to it, whichever step of drafts holds it
            stopped = speculative.speculative(runner, [0], 12, speculative.Stats(runner.depths), choose=choose, stop=7)
            assert stopped == speculative.greedy(runner, [0], 12, choose=choose, stop=7), (drafts, sequence)
            assert stopped == (output[: output.index(7) + 1] if 7 in output else output), (drafts, sequence)
    assert len({tuple(speculative.greedy(NoisyMain([]), [0], 12, choose=speculative.GumbelSampler(3, s)))
                for s in range(5)}) > 1  # the keys do sample different texts


# the README's flag set that makes the main command's model Llama-shaped (RMSNorm, SwiGLU, no biases)
LLAMA_SHAPED = ("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear")


@pytest.mark.parametrize("config, extra, architecture", [
    ("deepseek_v3_tiny", (), "DeepseekV3ForCausalLM"),
    # DeepSeek-V3's MoE with grouped-query attention: transformers' DeepSeek-V3 is MLA only, GLM-4.5 is this
    pytest.param("deepseek_v3_moe_tiny", (), "Glm4MoeForCausalLM", marks=pytest.mark.matrix),
    # DeepSeek-V3's MTP recipe on the command's model: the README's Llama-shaped one
    pytest.param("deepseek_v3_d1", LLAMA_SHAPED, "LlamaForCausalLM", marks=pytest.mark.matrix),
    pytest.param("qwen3_next_gpt_tiny", (), "Qwen3NextForCausalLM", marks=pytest.mark.matrix),
    # the GPU scripts' DeepSeek-V3-shaped MoE, its routing and MTP as configured, its sizes CPU's:
    # 16 experts in its 8 groups, a tiny FFN, one rank, no grouped GEMM (a CUDA kernel), and
    # gpu_args.sh's RMSNorm, SwiGLU and no biases
    pytest.param("deepseek_v3_moe_gpu", (*LLAMA_SHAPED, "--num-experts", "16", "--moe-ffn-hidden-size", "16",
                                         "--moe-shared-expert-intermediate-size", "16",
                                         "--moe-layer-freq", "([0]*1+[1]*3)", "--expert-model-parallel-size", "1"),
                 "Glm4MoeForCausalLM", marks=pytest.mark.matrix),
])
def test_an_example_config_exports_to_its_family_and_computes_what_transformers_computes(config, extra, architecture,
                                                                                          tmp_path):
    """The example configs that name a Hugging Face family: deepseek_v3_tiny.sh (MLA with YaRN by
    default, grouped sigmoid routing) as DeepSeek-V3, deepseek_v3_moe_tiny.sh (the same MoE without
    MLA) as GLM-4.5, deepseek_v3_d1.sh (an MTP recipe) on a Llama-shaped model as Llama,
    qwen3_next_gpt_tiny.sh as Qwen3-Next, deepseek_v3_moe_gpu.sh (at CPU sizes) as GLM-4.5, with nothing
    refused, and transformers computes their logits."""
    trained = tmp_path / "trained"
    flags = [flag for flag in example_flags(config) if flag != "--moe-grouped-gemm"]
    train(1, *TINY, *flags, *extra, "--num-layers", "4", "--lr", "1e-3", "--train-iters", "1",
          "--save", str(trained), "--save-interval", "1", timeout=300)
    result = launch("tests.bodies.serving:example_export", 1, {"trained": str(trained), "out": str(tmp_path / "hf")},
                    timeout=300)[0]
    assert result["architectures"] == [architecture], result
    assert result["logits"] < 1e-5, result


@pytest.mark.matrix  # the default tier: export refuses a HybridModel checkpoint in one line (below)
def test_the_d1_config_on_the_quick_start_s_gpt_is_refused_naming_each_difference(tmp_path):
    """deepseek_v3_d1.sh sets MTP only: on the quick start's GPT (LayerNorm, GELU, biases) export
    names those three, each with the flag that makes the model Llama-shaped."""
    trained = tmp_path / "trained"
    train(1, *TINY, *example_flags("deepseek_v3_d1"), "--lr", "1e-3", "--train-iters", "1", "--save", str(trained),
          "--save-interval", "1", timeout=300)
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", str(trained),
                             str(tmp_path / "out")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert errors[0].endswith("it has --normalization LayerNorm (needs RMSNorm), no --swiglu (needs SwiGLU), linear "
                              "biases (needs --disable-bias-linear)"), errors
    assert not (tmp_path / "out").exists()


def test_the_main_command_with_the_readme_s_llama_flags_exports_as_llama(tmp_path):
    assert " ".join(LLAMA_SHAPED) in (REPO_ROOT / "README.md").read_text()
    trained = tmp_path / "runs" / "llama"
    train(2, *LLAMA_SHAPED, "--save", str(trained), "--train-iters", "2", "--save-interval", "2", "--eval-iters", "0",
          cwd=tmp_path, script=str(REPO_ROOT / "pretrain_gpt_mtp.py"), timeout=300)
    result = launch("tests.bodies.serving:example_export", 1, {"trained": str(trained), "out": str(tmp_path / "hf")},
                    timeout=300)[0]
    assert result["architectures"] == ["LlamaForCausalLM"], result
    assert result["logits"] < 1e-5, result
    # what a user then meets in transformers and the engines is said at export (issue 41)
    assert "no tokenizer files written: give --tokenizer DIR" in result["printed"], result["printed"]
    # no engine drafts with Llama's MTP depths and vLLM's loader refuses them: left out, saying how to keep them
    assert "the backbone only (2 MTP depths left out)" in result["printed"], result["printed"]
    assert "no engine drafts with LlamaForCausalLM's and vLLM's loader refuses them; --mtp-layout mimo writes " \
        "them anyway" in result["printed"], result["printed"]


def test_a_hybridmodel_checkpoint_s_export_is_refused_naming_the_gptmodel_form(pipeline, tmp_path):
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export",
                             str(pipeline[0] / "trained-hybrid"),
                             str(tmp_path / "out")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert f"is a HybridModel (--hybrid-layer-pattern {HYBRID_PATTERN}), which export does not read" in errors[0], \
        errors
    assert "--experimental-attention-variant gated_delta_net" in errors[0], errors
