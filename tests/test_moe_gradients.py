# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MoE (+ MTP) full gradients after one exact step against the plain-PyTorch reference
(tests/reference/moe.py: router, top-k, expert bias, shared expert, SwiGLU/GELU experts and the
router losses written from spec section 11 and upstream's documented formulas).

Data: tiny_gpt's global batch (holes in the loss mask, sample 1 nearly empty: the valid
targets are far fewer than the routed positions, which every router loss counts). Layouts: one
rank, DP4 with micro-batches of 1, EP2 (DP4), EP2 x TP2 with sequence parallelism (DP2 x 2
micro-batches), PP2 x EP2 (MoE on both stages); allgather and alltoall dispatchers.
Tolerance: relative 1e-5 of each parameter's largest reference gradient (float32 round-off;
measured <= 9e-7 on every layout, 7.6e-7 on one rank); the expert biases after the step exactly
the reference's update (measured: 0 difference).

A repeated MTP layer's router losses count at every depth it runs, as distinct layers' do (spec
section 11): upstream divided the repeated layer's balance loss by mtp_num_layers (relative 0.27
off the spec's gradient here); the series' patch "MoE: a repeated MTP layer's balance loss counts
at every depth" makes it the spec's.

The attentions MoE models use (issue 27; matrix tier, current build): DeepSeek-V3's multi-latent
attention (q- and kv-LoRA, YaRN, q/k RMSNorm) and Qwen3-Next's gated attention (q/k RMSNorm, output
gate) over the same MoE layers, on every layout above (MLA's heads split over TP = 2 with EP = 2):
the same comparisons, against the reference's MLA and gated attention.

Qwen3-Next's hybrid over MoE (issue 27; matrix tier, current build: 0.16.1's HybridModel has no
MTP depths): a HybridModel "GE*E" (a Gated DeltaNet layer, attention, MoE layers; "GE|*E" under
PP) with MTP depths "/*E", D = 1 attached (sigmoid routing, expert bias, shared expert) and D = 2
isolated (softmax), on 70 tokens (the state crosses the torch kernel's 64-token chunk; decay
slowed as in tests.bodies.hybrid), against the reference's recurrent Gated DeltaNet and its MoE,
on one rank and every layout above (the DeltaNet's heads split over TP = 2 with EP = 2): measured
<= 3.7e-6 (the DeltaNet's dt_bias at EP2 x TP2; 2.2e-6 on one rank), every layout within 3.4e-6 of
one rank's, the expert biases exactly the reference's update. It fails with the output norm's
gradient scaled by 1.001 (1e-3 on every layout), with that norm's gradient not summed over TP
(0.51 and 0.91 at EP2 x TP2) and with the reference's decay applied to the new write too (0.034
and 0.087). Upstream's MoE layer refuses TP without sequence parallelism in training, so here the
norm is summed by its sequence-parallel rule; the series' sum for TP without SP (patch "Gated
DeltaNet: its output norm's gradient summed over tensor parallelism") is held by
tests/test_mtp_layouts.py.

Context parallelism (issue 39; current build): every setup above and MoE without router losses
(expert bias on and off) at CP = 2 x DP = 2 (allgather), CP = 2 x EP = 2 (alltoall) and TP = 2 with
SP x CP = 2 x EP = 2 (allgather; matrix tier), each CP rank
routing its two chunks of every sequence: every CP rank's copy of every full gradient against the
reference on whole sequences and against one rank, the expert biases after the step exactly the
reference's update, each depth's router losses the reference's. Measured: every case passes at
rel 1e-5. It fails with the routers' TP-CP group reduced to TP, so each rank's balance-loss
statistics are its piece's (0.27-0.42 in every balance-loss setup), with T counted from each rank's
piece (1.0-1.4 in every setup with router losses, z-loss alone included), with the expert bias
counted without CP (the biased setups' update off by twice the rate), and, without router losses,
with a CP rank's expert outputs detached (0.99-1.35, on CP = 2 x DP = 2).

Every carried build runs it (the default tier: 0.16.1 on one rank; docs/tests.md): on 0.16.1 the series'
backports (moe_grad_scale_func; the router's
per-token weights, without which the seq_aux_loss setups are 0.22-0.47 off on one rank) make it
exact.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5

MOE = dict(num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, add_bias_linear=False)
SEQ_Z = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
SIGMOID = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
               moe_router_bias_update_rate=1e-2)
SETUPS = {
    # DeepSeek-V3-like: sigmoid scores, expert bias, scaled top-k weights, shared expert, SwiGLU.
    "attached_D1_sigmoid_seq_z": dict(MOE, **SIGMOID, **SEQ_Z, mtp_num_layers=1, swiglu=True,
                                      moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=16),
    # Softmax (post-softmax top-k), GELU, shared expert; the first layer dense.
    "isolated_D2_softmax_seq_z": dict(MOE, **SEQ_Z, mtp_num_layers=2, mtp_detach_heads=True,
                                      moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1]),
    # The micro-batch balance loss (its value depends on the micro-batch size, its weight must not).
    "attached_D2_pre_softmax_aux_z": dict(MOE, mtp_num_layers=2, moe_router_pre_softmax=True, swiglu=True,
                                          moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
                                          moe_z_loss_coeff=0.01),
    "isolated_D2_repeated_sigmoid_z": dict(MOE, **SIGMOID, mtp_num_layers=2, mtp_detach_heads=True,
                                           mtp_use_repeated_layer=True, swiglu=True, moe_z_loss_coeff=0.01),
    "attached_D2_repeated_sigmoid_seq_z": dict(MOE, **SIGMOID, **SEQ_Z, mtp_num_layers=2,
                                               mtp_use_repeated_layer=True, swiglu=True),
}
LAYOUTS = [
    dict(name="dp4_mb1_allgather", tp=1, pp=1, ep=1, setup=dict(micro_batch=1)),
    dict(name="ep2_dp4_alltoall", tp=1, pp=1, ep=2, setup=dict(moe_token_dispatcher_type="alltoall")),
    dict(name="ep2_tp2_sp_dp2_allgather", tp=2, pp=1, ep=2),
    dict(name="pp2_ep2_dp2_alltoall", tp=1, pp=2, ep=2, setup=dict(moe_token_dispatcher_type="alltoall")),
]
# (a repeated layer at D = 1 is the distinct one: each architecture's setups are SETUPS' own)
ARCH_SETUPS = {
    "mla_yarn_attached_D1_sigmoid_seq_z": dict(SETUPS["attached_D1_sigmoid_seq_z"], arch="mla_yarn"),
    "mla_yarn_isolated_D2_repeated_sigmoid_z": dict(SETUPS["isolated_D2_repeated_sigmoid_z"], arch="mla_yarn"),
    "gated_isolated_D2_softmax_seq_z": dict(SETUPS["isolated_D2_softmax_seq_z"], arch="qk_rmsnorm_gate"),
}
# Qwen3-Next's hybrid (issue 27): a Gated DeltaNet layer "G", attention "*" and MoE layers "E",
# MTP depths "/*E" (tests.harness.tiny_gpt.hybrid_layer_pattern: "GE*E/*E", "GE|*E/*E" under PP);
# SwiGLU (the DeltaNet's convolution and output gate use SiLU); 70 tokens, so that the state
# crosses the torch kernel's 64-token chunk (tests.bodies.hybrid.DELTA_NET_SEQ).
DELTA_NET = dict(arch="delta_net", hybrid=True, seq_length=70)
DELTA_NET_SETUPS = {
    "delta_net_attached_D1_sigmoid_seq_z": dict(SETUPS["attached_D1_sigmoid_seq_z"], **DELTA_NET),
    "delta_net_isolated_D2_softmax_seq_z": dict(MOE, **SEQ_Z, **DELTA_NET, mtp_num_layers=2, mtp_detach_heads=True,
                                                swiglu=True),
}
# A draft objective of spec section 12 over MoE (current build: 0.16.1 trains ce only): tv at
# temperature 0.8 with isolated heads, whose MTP layer is MoE with its own router losses; the main
# head's distribution at t + k is a target, so the MoE routing and losses are those of ce.
DRAFT_SETUPS = {
    "isolated_D2_tv_softmax_seq_z": dict(SETUPS["isolated_D2_softmax_seq_z"], mtp_loss_type="tv",
                                         mtp_draft_temperature=0.8),
}
BREAKS = [["attached_D1_sigmoid_seq_z", "no_division"], ["attached_D1_sigmoid_seq_z", "valid_tokens"]]
# Context parallelism (issue 39; current build: 0.16.1 refuses MTP and the router losses under CP):
# each CP rank routes its two chunks of every sequence. Every setup above, and MoE without router
# losses (expert bias on and off), on CP = 2 x DP = 2, CP = 2 x EP = 2 (x DP = 2) and TP = 2 (SP) x
# CP = 2 x EP = 2.
NO_ROUTER_LOSSES = {
    "isolated_D1_sigmoid_no_router_losses": dict(MOE, **SIGMOID, mtp_num_layers=1, mtp_detach_heads=True,
                                                 swiglu=True, moe_shared_expert_intermediate_size=16),
    "attached_D2_softmax_no_router_losses": dict(MOE, mtp_num_layers=2),
}
CP_SETUPS = {**SETUPS, **NO_ROUTER_LOSSES}
CP_LAYOUTS = [
    dict(name="cp2_dp2_allgather", tp=1, pp=1, ep=1, cp=2),
    dict(name="cp2_ep2_dp2_alltoall", tp=1, pp=1, ep=2, cp=2, setup=dict(moe_token_dispatcher_type="alltoall")),
    dict(name="tp2_sp_cp2_ep2_allgather", tp=2, pp=1, ep=2, cp=2),  # the router's TP-CP group both ways
]
# one case of each kind in the default tier: each balance loss with the z-loss, D = 1 and 2, isolated
# and attached, each layout, and MoE without router losses; the others in the matrix tier
CP_DEFAULT_CASES = {("cp2_ep2_dp2_alltoall", "isolated_D2_softmax_seq_z"),
                    ("cp2_dp2_allgather", "attached_D2_pre_softmax_aux_z"),
                    ("cp2_dp2_allgather", "attached_D1_sigmoid_seq_z"),
                    ("cp2_ep2_dp2_alltoall", "isolated_D1_sigmoid_no_router_losses")}


@pytest.fixture(scope="module")
def ckpt_root(build, tmp_path_factory):
    return str(tmp_path_factory.mktemp(f"moe-ckpt-{build}"))


@pytest.fixture(scope="module")
def one_rank(build, ckpt_root):
    """One rank against the reference (it writes the initial weights the layouts load)."""
    (result,) = launch("tests.bodies.moe_gradients:reference", 1,
                       {"ckpt_root": ckpt_root, "setups": SETUPS, "breaks": BREAKS}, timeout=600, build=build)
    return result


@pytest.fixture(scope="module")
def runs(build, ckpt_root, one_rank):
    ranks = launch("tests.bodies.moe_gradients:layouts", 4,
                   {"ckpt_root": ckpt_root, "layouts": LAYOUTS, "setups": SETUPS}, timeout=600, build=build)
    return one_rank, ranks


@pytest.fixture(scope="module")
def cp_runs(build, matrix, ckpt_root, one_rank):
    """One rank on the setups without router losses (SETUPS' are one_rank's), then the CP layouts
    on 4 ranks (the default cases; with --matrix every case)."""
    if build != "0.19.2":
        pytest.skip("MTP and the router losses under context parallelism are 0.19.2's (0.16.1 refuses them)")
    (no_losses,) = launch("tests.bodies.moe_gradients:reference", 1,
                          {"ckpt_root": ckpt_root, "setups": NO_ROUTER_LOSSES}, timeout=600, build=build)
    layouts = [dict(layout, setups=[name for name in CP_SETUPS if matrix or (layout["name"], name) in CP_DEFAULT_CASES])
               for layout in CP_LAYOUTS]
    ranks = launch("tests.bodies.moe_gradients:layouts", 4,
                   {"ckpt_root": ckpt_root, "layouts": [layout for layout in layouts if layout["setups"]],
                    "setups": CP_SETUPS}, timeout=900, build=build)
    return no_losses, ranks


def assert_matches(grads):
    assert not grads["missing"] and not grads["extra"], (grads["missing"], grads["extra"])
    assert grads["copies"] >= len(SETUPS) and grads["max_rel"] < TOL, (grads["worst"], grads["max_rel"])


@pytest.mark.parametrize("setup", list(SETUPS))
def test_one_rank_matches_the_reference(one_rank, setup):
    assert_matches(one_rank[setup]["grads"])


@pytest.mark.parametrize("layout,setup", [(layout["name"], name) for layout in LAYOUTS for name in SETUPS])
def test_layout_matches_the_reference(runs, layout, setup):
    """Every copy of every full gradient on every rank (experts gathered over EP, shards over
    TP / ETP, replicas over TP, both word-embedding copies under PP)."""
    _, ranks = runs
    assert len(ranks) == 4
    for rank in ranks:
        assert_matches(rank[f"{layout}/{setup}"]["grads"])


@pytest.mark.parametrize("layout", ["one_rank"] + [layout["name"] for layout in LAYOUTS])
def test_expert_bias_after_the_step_is_the_reference_update(runs, layout):
    """sign(mean - count) * rate over the step's global counts of the biased routing, whatever
    the cut (1 x 4 micro-batches, DP4 x 2 of 1, DP4 x 1, DP2 x 2, PP2 x DP2)."""
    one_rank, ranks = runs
    results = [one_rank] if layout == "one_rank" else [{n: r[f"{layout}/{n}"] for n in SETUPS} for r in ranks]
    for result in results:
        for name, kwargs in SETUPS.items():
            bias = result[name]["bias"]
            assert not bias["missing"], (name, bias["missing"])
            if kwargs.get("moe_router_enable_expert_bias"):
                assert bias["copies"] > 0, name
                assert bias["max_abs"] == 0.0, (name, bias["max_abs"])


@pytest.mark.parametrize("layout", [layout["name"] for layout in LAYOUTS])
def test_cut_invariance_against_one_rank(runs, layout):
    """The same global batch as 1 x 4 micro-batches of 2 (one rank) and as this layout's cut
    (DP4 x 2 of 1, DP4 x 1 of 2, DP2 x 2 of 2) gives the same gradients, compared directly
    (megatron against megatron). The micro-batch balance loss is cut-dependent by definition:
    it compares only where its micro-batches are the same."""
    _, ranks = runs
    for rank in ranks:
        for name, kwargs in SETUPS.items():
            result = rank[f"{layout}/{name}"]
            if "aux_loss" == kwargs.get("moe_router_load_balancing_type") and result["micro_batch"] != 2:
                assert result["vs_one_rank"]["max_rel"] > 1e-3, name  # (and it matched its own reference)
                continue
            assert result["vs_one_rank"]["max_rel"] < TOL, (name, result["vs_one_rank"]["worst"])


def test_a_wrong_router_loss_denominator_is_detected(one_rank):
    """The comparison fails when the router losses are divided by nothing (the loss scale
    alone) or by the step's valid targets instead of its routed tokens."""
    for name, mode in BREAKS:
        assert one_rank[f"broken-{mode}/{name}"]["grads"]["max_rel"] > 1e-2, (name, mode)


@pytest.mark.parametrize("layout", ["one_rank"] + [layout["name"] for layout in LAYOUTS])
def test_each_mtp_depths_router_losses_are_the_step_values(runs, layout):
    """The step's `mtp_k z loss` (token mean) and `mtp_k seq load balancing loss` (sequence
    mean) equal the reference's for every depth, distinct and repeated layers, on every layout
    (TP / SP / EP / PP reductions); rel 1e-5 (float32)."""
    one_rank, ranks = runs
    results = [one_rank] if layout == "one_rank" else [{n: r[f"{layout}/{n}"] for n in SETUPS} for r in ranks]
    checked = 0
    for result in results:
        for name in SETUPS:
            want, got = result[name]["depth_router_losses"], result[name]["metrics"]
            for key, value in want.items():
                assert abs(got[key] - value) <= TOL * abs(value), (layout, name, key, got.get(key), value)
                checked += 1
            assert not {k for k in got if k.endswith(("load balancing loss", "z loss"))} - set(want), (name, got)
    assert checked >= len(results) * 6, checked


def cp_cases():
    return [pytest.param(layout["name"], name, marks=[] if (layout["name"], name) in CP_DEFAULT_CASES
                         else [pytest.mark.matrix]) for layout in CP_LAYOUTS for name in CP_SETUPS]


@pytest.mark.parametrize("layout,setup", cp_cases())
def test_context_parallel_matches_the_reference(cp_runs, layout, setup):
    """Every CP rank's copy of every full gradient (experts gathered over EP) against the reference on
    whole sequences, and against one rank's megatron step; the expert biases after the step the
    reference's update (the step's tokens per expert over every CP piece); each depth's router losses
    the reference's step values (rel 1e-5)."""
    no_losses, ranks = cp_runs
    assert len(ranks) == 4
    if setup in NO_ROUTER_LOSSES:
        assert_matches(no_losses[setup]["grads"])
    kwargs = CP_SETUPS[setup]
    for rank in ranks:
        result = rank[f"{layout}/{setup}"]
        assert_matches(result["grads"])
        vs_one_rank = result["vs_one_rank"]
        assert vs_one_rank["max_rel"] < TOL, (vs_one_rank["worst"], vs_one_rank["max_rel"])
        assert not result["bias"]["missing"] and result["bias"]["max_abs"] == 0.0, result["bias"]
        assert bool(result["bias"]["copies"]) == bool(kwargs.get("moe_router_enable_expert_bias")), result["bias"]
        want, got = result["depth_router_losses"], result["metrics"]
        for key, value in want.items():
            assert abs(got[key] - value) <= TOL * abs(value), (key, got.get(key), value)
        assert {k for k in got if k.endswith(("load balancing loss", "z loss"))} == set(want), (got, want)
        assert bool(want) == router_losses_on(kwargs), want


def router_losses_on(kwargs: dict) -> bool:
    return bool(kwargs.get("moe_aux_loss_coeff") or kwargs.get("moe_z_loss_coeff"))


def assert_all_layouts_match_the_reference(ckpt_root: str, setups: dict):
    """One rank and every layout of LAYOUTS against the reference, every copy; the expert biases
    after the step are the reference's update; every layout's gradients equal one rank's."""
    (one_rank,) = launch("tests.bodies.moe_gradients:reference", 1, {"ckpt_root": ckpt_root, "setups": setups},
                         timeout=600)
    ranks = launch("tests.bodies.moe_gradients:layouts", 4,
                   {"ckpt_root": ckpt_root, "layouts": LAYOUTS, "setups": setups}, timeout=900)
    assert len(ranks) == 4
    for name, kwargs in setups.items():
        results = [one_rank[name]] + [rank[f"{layout['name']}/{name}"] for rank in ranks for layout in LAYOUTS]
        for result in results:
            assert_matches(result["grads"])
            assert not result["bias"]["missing"] and result["bias"]["max_abs"] == 0.0, (name, result["bias"])
            if kwargs.get("moe_router_enable_expert_bias"):
                assert result["bias"]["copies"] > 0, name
        for result in results[1:]:
            assert result["vs_one_rank"]["max_rel"] < TOL, (name, result["vs_one_rank"]["worst"])


def test_a_step_without_counts_up_front_refuses_router_losses():
    (result,) = launch("tests.bodies.moe_gradients:streaming_refusal", 1,
                       {"setup_kwargs": SETUPS["isolated_D2_softmax_seq_z"]}, timeout=300)
    assert result["message"] and "counts up front" in result["message"] and "\n" not in result["message"], result
    assert result["unchanged"]


def test_a_draft_objective_over_moe_matches_the_reference_on_every_layout(tmp_path):
    """EP = 2 (alltoall; with TP = 2 and SP; under PP = 2) and DP = 4 with micro-batches of one."""
    assert_all_layouts_match_the_reference(str(tmp_path), DRAFT_SETUPS)


@pytest.mark.matrix
def test_mla_and_gated_attention_over_moe_match_the_reference(tmp_path):
    """The current build (0.16.1 builds no multi-latent attention without Transformer Engine)."""
    assert_all_layouts_match_the_reference(str(tmp_path), ARCH_SETUPS)


@pytest.mark.matrix
def test_gated_delta_net_hybrid_over_moe_matches_the_reference(tmp_path):
    """The current build (0.16.1's HybridModel has no MTP depths)."""
    assert_all_layouts_match_the_reference(str(tmp_path), DELTA_NET_SETUPS)
