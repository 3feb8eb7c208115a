# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Architecture flags build what they name: the trainer's model against upstream's builder (issue 27).

For every architecture flag (q/k layernorm with either norm, --qk-l2-norm, multi-latent
attention with YaRN and with plain RoPE, gated attention output, partial rotary, MLA + MoE
with a dense first layer), the model pretrain_gpt_mtp.py builds has exactly the parameter
names and shapes of the model upstream's builder (megatron.training.models.gpt, Megatron-LM's
gpt_builders.py choices) gives for the same arguments, and holds the modules the flag names
in every attention layer, decoder and MTP: before, the trainer built its dense layers with
no arguments and dropped --qk-layernorm and --multi-latent-attention without a word. A flag
the selected specs do not build is refused in one line. Qwen3-Next's GPTModel form
(--experimental-attention-variant gated_delta_net, refused on CPU before the series' runtime
patch for it): its decoder has upstream's builder's names and shapes, its layers alternate as
--linear-attention-freq says, and each MTP layer is the decoder's last (0.19.2's
mtp_block_spec asserts on the variant; Megatron-LM's gpt_builders.py builds it so).

Zero-centred gamma (--apply-layernorm-1p) is built on CPU (the series' torch norms: (1 + w), w
started at zero), every norm of the model, q/k norms too.

Exact MTP on the architectures: q/k LayerNorm, q/k RMSNorm, zero-centred RMSNorm with q/k norms
and zero-centred LayerNorm (their weights moved off zero), multi-latent attention with RoPE,
and with YaRN (factor 4, both mscales) and q/k RMSNorm, each against the plain-PyTorch
reference (tests/reference/gpt_mtp.py, MLA and YaRN written from the papers) for D in {1, 2},
isolation on and off, the repeated layer, tied and untied, recompute, padded rows with holes
and packed rows of uneven segments, dense and sparse MTP loss: logits, losses, every
parameter's gradient and the per-depth counts (exact). Tolerance: relative 3e-5 of each
tensor's largest magnitude (float32 round-off; measured <= 9.7e-6, the largest on
k_layernorm.bias, a gradient that only RoPE keeps from cancelling to zero: its largest entry
is 1e-3 of the others').

Cut invariance on the architectures (the trainer's exact steps): from the same weights,
1 rank x 4 micro-batches and the other cuts log the same lm loss, per-depth MTP losses and
grad norm at every iteration (relative 2e-5), D = 2 isolated, short documents with
--eod-mask-loss (matrix tier): DeepSeek-V3's attention (MLA with q- and kv-LoRA, YaRN, q/k RMSNorm) with MoE
behind a dense first layer, cut by DP = 2 and EP = 2; Qwen3's (q/k RMSNorm, gated attention
output, partial rotary) by DP = 2 and TP = 2 (the head split); Qwen3-Next's as a GPTModel
(--experimental-attention-variant gated_delta_net: Gated DeltaNet layers, every second layer gated
attention, zero-centred norms) by DP = 2 and TP = 2. The DeepSeek-V3 checkpoint
loaded by a model without MLA and q/k norms is refused in one line naming both fields.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.harness import argument_cases, launch
from tests.harness.launcher import REPO_ROOT
from tests.harness.reference_checks import failed_checks
from tests.harness.trainer import TINY, close, scalars, train

pytestmark = pytest.mark.slow

MLA = ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16")
GATED_DELTA_NET = ("--swiglu", "--normalization", "RMSNorm", "--linear-num-key-heads", "2", "--linear-num-value-heads",
                   "4", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16", "--linear-conv-kernel-dim", "4")
CASES = {
    "default": (),
    "qk_layernorm": ("--qk-layernorm",),
    "qk_layernorm_rmsnorm": ("--qk-layernorm", "--normalization", "RMSNorm"),
    "qk_l2_norm": ("--qk-l2-norm",),
    "mla_yarn": MLA,
    "mla_rope_qk_layernorm": (*MLA, "--rope-type", "rope", "--qk-layernorm"),
    "attention_output_gate": ("--attention-output-gate",),
    "rotary_percent": ("--rotary-percent", "0.5"),
    "mla_moe_dense_first": (*MLA, "--qk-layernorm", "--normalization", "RMSNorm", "--num-experts", "4",
                            "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--moe-layer-freq",
                            "[0,1,1,1]"),
    "hybrid_qk_layernorm": ("--hybrid-layer-pattern", "*-*-/*-/*-", "--qk-layernorm"),
    "apply_layernorm_1p": ("--apply-layernorm-1p",),
    "apply_layernorm_1p_qk_rmsnorm": ("--apply-layernorm-1p", "--qk-layernorm", "--normalization", "RMSNorm"),
    # Qwen3-Next's GPTModel form: Gated DeltaNet layers, every second layer gated full attention
    "gated_delta_net": ("--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
                        *GATED_DELTA_NET, "--qk-layernorm", "--attention-output-gate", "--apply-layernorm-1p"),
    # its MTP layer is the decoder's last: dense here, where a plain GPT layer would be MoE
    "gated_delta_net_moe_dense_last": ("--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
                                       "2", *GATED_DELTA_NET, "--num-experts", "4", "--moe-router-topk", "2",
                                       "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[1,1,1,0]",
                                       "--disable-bias-linear"),
    "refused_gated_delta_net_without_swiglu": ("--experimental-attention-variant", "gated_delta_net",
                                               "--linear-attention-freq", "2"),
    "refused_dsa": ("--experimental-attention-variant", "dsa", *MLA, "--disable-bias-linear"),
}
DEPTHS = 2  # the embedded default's MTP depths: every case's MTP layers are checked with the decoder's


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("architectures"))
    (result,) = launch("tests.bodies.architectures:builder_cases", 1,
                       {"cases": {k: list(v) for k, v in CASES.items()}, "save": save}, timeout=600)
    return result


@pytest.fixture(scope="module")
def reference_cases():
    (result,) = launch("tests.bodies.architectures:against_the_reference", 1, timeout=600)
    return result


REFERENCE_TOL = 3e-5


def test_mtp_on_each_architecture_matches_the_reference(reference_cases):
    assert len(reference_cases) == 7 * 5  # architectures x setups (tests/bodies/architectures.py)
    failures = {name: failed for name, errors in reference_cases.items()
                if (failed := failed_checks(name, errors, REFERENCE_TOL))}
    assert not failures, failures


BUILT = [name for name in CASES if not name.startswith(("hybrid", "refused"))]
ATTENTION = [name for name in BUILT if not name.startswith("gated_delta_net")]


DRY_RUNS = """
    import contextlib, io, sys
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars
    import pretrain_gpt_mtp
    for argv in ARGVS:
        destroy_num_microbatches_calculator()  # each run sets Megatron-LM's globals anew
        global_vars.unset_global_variables()
        sys.argv = ["pretrain_gpt_mtp.py", "--dry-run", *argv]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = pretrain_gpt_mtp.main()
        print(status, [line for line in printed.getvalue().splitlines() if "arguments OK" in line])
"""


def test_a_dry_run_counts_the_parameters_of_the_model_the_run_builds(results, tmp_path):
    """--dry-run's line gives the parameters of the model the trainer builds (the `results`
    fixture's, built on the CPU; dense and MLA + MoE), counted without building it on a device,
    and writes nothing (the embedded default's TensorBoard directory is under --save). Mamba
    layers, which only Transformer Engine builds (a dry run here for GPUs), are not counted: the
    local stack would leave them empty."""
    cases = ("default", "mla_moe_dense_first")
    mamba = ["--transformer-impl", "transformer_engine", "--hybrid-layer-pattern", "M*M-/*-/*-"]
    argvs = [[*CASES[case], "--save", str(tmp_path / case)] for case in cases] + [[*mamba, "--save",
                                                                                   str(tmp_path / "mamba")]]
    result = subprocess.run([sys.executable, "-c", f"ARGVS = {argvs!r}\n" + textwrap.dedent(DRY_RUNS)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    lines = [line for line in result.stdout.splitlines() if line.startswith(("0 ", "2 "))]
    assert len(lines) == len(argvs), (result.stdout[-2000:], result.stderr[-3000:])
    *counted_lines, mamba_line = lines
    assert "parameters: not counted without Transformer Engine (HybridModel layers M);" in mamba_line, mamba_line
    for case, line in zip(cases, counted_lines, strict=True):
        assert line.startswith("0 ") and "arguments OK" in line, line
        counted = re.search(r"parameters: ([0-9,]+) \(", line)
        assert counted and int(counted.group(1).replace(",", "")) == results[case]["parameters"], (case, line)
    assert not any(tmp_path.iterdir()), list(tmp_path.rglob("*"))


@pytest.mark.parametrize("case", BUILT)
def test_same_parameter_names_and_shapes_as_upstreams_builder(results, case):
    result = results[case]
    assert "refused" not in result, result
    if case.startswith("gated_delta_net"):  # the MTP layers: test_gated_delta_net_on_gptmodel_...
        assert {k: v for k, v in result["ours"].items() if not k.startswith("mtp.")} == result["upstream"]
    else:
        assert result["ours"] == result["upstream"]


def test_gated_delta_net_on_gptmodel_places_its_layers_as_upstream(results):
    result = results["gated_delta_net"]
    # --linear-attention-freq 2: every second layer full attention (upstream's pattern), the
    # MTP layer the decoder's last layer spec (Megatron-LM's gpt_builders.py), at every depth
    assert result["mixers"] == ["GatedDeltaNet", "SelfAttention"] * 2
    assert result["mtp_mixers"] == ["SelfAttention"] * DEPTHS
    ours = result["ours"]
    last = {k.split(".", 3)[3]: v for k, v in ours.items() if k.startswith("decoder.layers.3.")}
    for depth in range(DEPTHS):
        prefix = f"mtp.layers.{depth}.mtp_model_layer."
        assert {k[len(prefix):]: v for k, v in ours.items() if k.startswith(prefix)} == last
    gated_delta_net = {k.split(".", 4)[4] for k in ours if k.startswith("decoder.layers.0.self_attention.")}
    assert gated_delta_net == {"in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight",
                               "out_proj.weight"}
    assert result["norms"] == ["ZeroCenteredRMSNorm"] and result["norm_weights_zero"]
    assert result["loss"] == result["loss"] and 0 < result["loss"] < 20  # finite: the layers run here
    # checkpoints name the norms as Transformer Engine's fused layers do (TELayerNormColumnParallelLinear's
    # layer_norm_weight), so they move between the local and the TE model
    keys = set(result["norm_keys"])
    assert {"decoder.layers.0.self_attention.in_proj.layer_norm_weight",
            "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
            "mtp.layers.1.transformer_layer.self_attention.linear_qkv.layer_norm_weight",
            "mtp.layers.1.transformer_layer.mlp.linear_fc1.layer_norm_weight"} <= keys
    assert not any("input_layernorm" in key or "pre_mlp_layernorm" in key for key in keys), sorted(keys)


def test_gated_delta_net_on_gptmodel_takes_the_decoders_last_layer_for_mtp(results):
    # Megatron-LM's gpt_builders.py: the MTP layer is the decoder's last layer spec, here a dense one
    # (--moe-layer-freq [1,1,1,0]) where a plain GPT layer of the config would be an MoE layer
    ours = results["gated_delta_net_moe_dense_last"]["ours"]
    assert any(".experts." in name for name in ours if name.startswith("decoder.layers.0."))
    assert not any(".experts." in name or ".router." in name for name in ours if name.startswith("mtp."))
    assert any(name.startswith("mtp.layers.0.mtp_model_layer.mlp.linear_fc1") for name in ours)


@pytest.mark.parametrize("case", ATTENTION)
def test_every_attention_layer_holds_what_the_flag_names(results, case):
    result = results[case]
    layers = 4 + DEPTHS  # decoder and MTP layers
    assert result["attention_layers"] == layers
    assert result["core_attention"] == ["SDPACoreAttention"]  # the one CPU swap
    assert result["attention"] == (["MLASelfAttention"] if "mla" in case else ["SelfAttention"])
    norms = {"qk_layernorm": ["LayerNorm"], "qk_layernorm_rmsnorm": ["RMSNorm"], "qk_l2_norm": ["L2Norm"],
             "mla_rope_qk_layernorm": ["LayerNorm"], "mla_moe_dense_first": ["RMSNorm"],
             "apply_layernorm_1p_qk_rmsnorm": ["ZeroCenteredRMSNorm"]}
    # without q/k norms: SelfAttention holds None, MLASelfAttention upstream's IdentityOp
    expected = norms.get(case, ["IdentityOp"] if "mla" in case else ["NoneType"])
    assert result["qk_norms"] == expected
    assert result["gate"] == [case == "attention_output_gate"]
    assert result["loss"] == result["loss"] and 0 < result["loss"] < 20  # finite: the layers run here


def test_zero_centred_gamma_makes_every_norm_zero_centred(results):
    assert results["default"]["norms"] == ["LayerNorm"]
    assert results["apply_layernorm_1p"]["norms"] == ["ZeroCenteredLayerNorm"]  # decoder, final, MTP norms alike
    assert results["apply_layernorm_1p_qk_rmsnorm"]["norms"] == ["ZeroCenteredRMSNorm"]
    # w starts at zero (a scale of 1), as Transformer Engine's; torch's plain norms start at a weight of 1
    assert (results["apply_layernorm_1p"]["norm_weights_zero"]
            and results["apply_layernorm_1p_qk_rmsnorm"]["norm_weights_zero"])
    assert not results["default"]["norm_weights_zero"]


def test_flags_change_the_parameters(results):
    # what the old builder got wrong: every flag below gave the default's parameters
    default = results["default"]["ours"]
    for case in ("qk_layernorm", "mla_yarn", "attention_output_gate", "mla_moe_dense_first"):
        assert results[case]["ours"] != default, case
    assert any("q_layernorm" in name for name in results["qk_layernorm"]["ours"])
    assert any("linear_kv_down_proj" in name for name in results["mla_yarn"]["ours"])
    assert any(".experts." in name for name in results["mla_moe_dense_first"]["ours"])
    assert not any(".experts." in name for name in results["mla_moe_dense_first"]["ours"]
                   if name.startswith("decoder.layers.0."))


@pytest.mark.parametrize("case,flag", [("hybrid_qk_layernorm", "--qk-layernorm"),
                                       ("refused_dsa", "--experimental-attention-variant dsa"),
                                       ("refused_gated_delta_net_without_swiglu", "give --swiglu")])
def test_a_flag_the_specs_do_not_build_is_refused_in_one_line(results, case, flag):
    refused = results[case]["refused"]
    assert flag in refused and "\n" not in refused


DEEPSEEK_V3_MOE = ("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
                   "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]",
                   "--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "seq_aux_loss",
                   "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall")
DEEPSEEK_V3 = (*MLA, "--qk-layernorm", *DEEPSEEK_V3_MOE)
QWEN3 = ("--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--attention-output-gate", "--rotary-percent", "0.5", "--group-query-attention", "--num-query-groups", "2")
QWEN3_NEXT_GPT = (*GATED_DELTA_NET, "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
                  "2", "--qk-layernorm", "--disable-bias-linear", "--attention-output-gate", "--rotary-percent", "0.25",
                  "--apply-layernorm-1p")
STEP = (*TINY, "--mtp-num-layers", "2", "--mtp-detach-heads", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eod-mask-loss", "--global-batch-size", "8", "--lr", "1e-3", "--make-vocab-size-divisible-by", "256")
ARCHITECTURES = {
    "deepseek_v3": (DEEPSEEK_V3, {"dp2x2": (2, ("--micro-batch-size", "2")),
                                  "ep2": (2, ("--micro-batch-size", "2", "--expert-model-parallel-size", "2"))}),
    "qwen3": (QWEN3, {"dp2x1": (2, ("--micro-batch-size", "4")),
                      "tp2": (2, ("--micro-batch-size", "2", "--tensor-model-parallel-size", "2"))}),
    # Qwen3-Next's GPTModel form: Gated DeltaNet layers (their heads split by TP = 2) and gated attention
    "qwen3_next_gpt": (QWEN3_NEXT_GPT, {"dp2x1": (2, ("--micro-batch-size", "4")),
                                       "tp2": (2, ("--micro-batch-size", "2", "--tensor-model-parallel-size", "2"))}),
}


@pytest.mark.matrix  # the default tier: MLA and q/k norms against the reference (library), and the trainer's build
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_trainer_steps_are_the_same_however_the_step_is_cut(architecture, dataset, tmp_path):
    flags, cuts = ARCHITECTURES[architecture]
    common = (*STEP, *flags, "--data-path", str(dataset))
    initial = tmp_path / "initial"
    train(1, *common, "--micro-batch-size", "8", "--train-iters", "1", "--save", str(initial), "--save-interval", "1")
    measured = {}
    for cut, (nproc, args) in {"1x4": (1, ("--micro-batch-size", "2")), **cuts}.items():
        train(nproc, *common, *args, "--load", str(initial), "--finetune", "--train-iters", "3",
              "--tensorboard-dir", str(tmp_path / cut))
        measured[cut] = scalars(tmp_path / cut)
    reference = measured.pop("1x4")
    for cut, values in measured.items():
        for tag in ("lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm", "mtp grad norm"):
            assert sorted(values[tag]) == sorted(reference[tag]) == [1, 2, 3], (cut, tag)
            for step in (1, 2, 3):
                assert close(values[tag][step], reference[tag][step]), (
                    f"{cut}, {tag}, step {step}: {values[tag][step]!r} vs 1x4 {reference[tag][step]!r}")


def test_the_trainer_refuses_a_flag_the_specs_do_not_build_in_one_line():
    run = train(1, *TINY, "--hybrid-layer-pattern", "*-*-", "--qk-layernorm", "--mock-data", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "64", "--train-iters", "1", "--lr", "1e-3", check=False)
    errors = run.errors()
    assert run.returncode != 0 and len(errors) == 1, run.tail()
    assert "--qk-layernorm is not built" in errors[0], errors


@pytest.mark.matrix  # the attention's fields in the default tier: test_trainer_faults' shape refusal (q/k norms)
def test_a_checkpoint_of_another_attention_is_refused_before_anything_is_built(tmp_path):
    common = (*TINY, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-3",
              "--global-batch-size", "2", "--train-iters", "1", "--normalization", "RMSNorm")
    train(1, *common, *MLA, "--qk-layernorm", "--save", str(tmp_path), "--save-interval", "1")
    (refused,) = argument_cases.check([{"argv": [*common, "--load", str(tmp_path)],
                                        "env": {"WORLD_SIZE": "1", "RANK": "0"}}], timeout=300)
    assert not refused["accepted"] and len(refused["errors"]) == 1, refused
    assert "multi_latent_attention: checkpoint True, model False" in refused["errors"][0], refused
    assert "qk_layernorm: checkpoint True, model False" in refused["errors"][0], refused
