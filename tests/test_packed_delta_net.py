# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Packed rows (THD) with Gated DeltaNet layers train exactly (issue 39 A), through upstream's own
packed path: GatedDeltaNet resolves the packed row's cu_seqlens (the padded ones where given) and
hands them to the fork's CPU kernels (tests/test_gated_delta_rule_packed.py), which reset the
state and the convolution at every sequence start; attention and the MTP roll stay within the
sequences. Against the reference's recurrent Gated DeltaNet within packed segments
(tests/reference/gpt_mtp.py), on packed rows of sequences of 5, 1, 67 and 3 tokens (odd lengths,
one of a single token, one past the torch kernel's chunk of 64) with holes in the mask; gates of
slow decay (tests/bodies/hybrid.py: slow_decay):

- one process, unpadded sequences: "G-*-" + "/*-" per depth in both model forms (HybridModel's
  pattern and GPTModel's --experimental-attention-variant gated_delta_net), D in {1, 2},
  isolation off and on; main loss, per-depth sums (counts exact) and every gradient;
- CP = 2 (sequences padded to multiples of 4, upstream's THD all-to-all from sequence to head
  parallelism), the same cases, gradients summed over the CP group;
- Gated DeltaNet over MoE ("GE*E" + "/*E" per depth, no router losses) through the library's
  exact step on four packed rows: one rank, EP = 2 (alltoall), EP = 2 x TP = 2 (sequence
  parallelism), PP = 2 x EP = 2 and CP = 2 x EP = 2; every copy of every full gradient.

- MoE router losses on packed rows (aux_loss and z-loss, spec section 11: T = every position of
  the step's rows, a packed sequence's padding included, each row one micro-batch of aux_loss)
  through the same step, D in {1, 2}, isolation off and on: every gradient and each MTP depth's
  reported router losses against the reference, on rows of sequences of 5, 1, 67 and 3 tokens,
  unpadded at one rank and EP = 2, padded to multiples of 4 at one rank, CP = 2 and CP = 2 x EP = 2
  (matrix tier);
- refused in one line before the gradient reduce, the weights untouched: seq_aux_loss on packed rows
  (upstream's statistic is the packed row's, not each sequence's) and upstream's padding mask with
  router losses.

Tolerance: relative 1e-5 of each compared tensor's largest magnitude (float32). Measured: <= 1e-6
in one process and at CP = 2, <= 2.8e-6 on the MoE layouts. The default tier runs the HybridModel
at D = 2 with isolation in one process; the rest is the matrix tier. 0.19.2 only (HybridModel's
MTP depths and the GPTModel form's layer selection are 0.19.2's).
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
CASES = [(1, False), (1, True), (2, False), (2, True)]  # (depths, isolation)
DEFAULT_CASES = [(2, True)]
MOE = dict(num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, add_bias_linear=False,
           arch="delta_net", hybrid=True, swiglu=True)
MOE_SETUPS = {"D1_attached_shared_expert": dict(MOE, mtp_num_layers=1, moe_shared_expert_intermediate_size=16),
              "D2_isolated": dict(MOE, mtp_num_layers=2, mtp_detach_heads=True)}
MOE_LAYOUTS = [dict(name="ep2_dp4_alltoall", tp=1, pp=1, ep=2, setup=dict(moe_token_dispatcher_type="alltoall")),
               dict(name="ep2_tp2_sp_dp2", tp=2, pp=1, ep=2), dict(name="pp2_ep2_dp2", tp=1, pp=2, ep=2),
               dict(name="cp2_ep2_dp2", tp=1, pp=1, ep=2, cp=2)]


def case_name(depths: int, detach: bool) -> str:
    return f"D{depths}_{'isolated' if detach else 'attached'}"


@pytest.fixture(scope="module")
def current(build):
    if build != "0.19.2":
        pytest.skip("HybridModel's MTP depths and the GPTModel form's Gated DeltaNet layers are 0.19.2's series")
    return build


def assert_exact(errors: dict, name: str) -> None:
    assert "error" not in errors, (name, errors.get("error"))
    assert errors["grad_names"] and errors["counts_exact"], (name, errors)
    for key in ("grads", "sums", "main_ce" if "main_ce" in errors else "main"):
        assert errors[key] < TOL, (name, key, errors[key])


@pytest.mark.parametrize("form", ["hybrid", pytest.param("gpt", marks=pytest.mark.matrix)])
def test_one_process_matches_the_recurrent_reference(current, matrix, form):
    cases = CASES if matrix else DEFAULT_CASES
    (got,) = launch("tests.bodies.hybrid:delta_net_packed", 1, {"form": form, "cases": cases}, timeout=600,
                    build=current)
    assert sorted(got) == sorted(case_name(*case) for case in cases)
    for name, errors in got.items():
        assert errors["delta_net_grads"] == 2, (name, errors)
        assert_exact(errors, f"{form}/{name}")


@pytest.mark.matrix
def test_context_parallel_matches_the_recurrent_reference(current):
    cases = [(depths, detach, False, "delta_net_packed") for depths, detach in CASES]
    ranks = launch("tests.bodies.context_parallel:against_reference", 2, {"cp": 2, "cases": cases}, timeout=600,
                   build=current)
    for rank in ranks:
        assert len(rank) == len(cases), sorted(rank)
        for name, errors in rank.items():
            assert_exact(errors, name)


@pytest.mark.matrix
def test_moe_layouts_match_the_recurrent_reference(current, tmp_path):
    args = {"ckpt_root": str(tmp_path), "setups": MOE_SETUPS}
    (one_rank,) = launch("tests.bodies.packed_delta_net:reference", 1, args, timeout=600, build=current)
    ranks = launch("tests.bodies.packed_delta_net:layouts", 4, dict(args, layouts=MOE_LAYOUTS), timeout=600,
                   build=current)
    assert_moe_runs(one_rank, ranks, len(MOE_LAYOUTS) * len(MOE_SETUPS))


def assert_moe_runs(one_rank: dict, ranks: list, per_rank: int) -> None:
    """Every run's full gradients, and its MTP depths' reported router losses, the reference's."""
    runs = {f"one_rank/{name}": run for name, run in one_rank.items()}
    for i, rank in enumerate(ranks):
        assert len(rank) == per_rank, sorted(rank)
        runs.update({f"{name}@rank{i}": run for name, run in rank.items()})
    for name, run in runs.items():
        grads = run["grads"]
        assert not grads["missing"] and not grads["extra"], (name, grads["missing"], grads["extra"])
        assert grads["max_rel"] < TOL, (name, grads["worst"], grads["max_rel"])
        want, got = run["depth_router_losses"], run["metrics"]
        for key, value in want.items():
            assert abs(got[key] - value) <= TOL * abs(value), (name, key, got.get(key), value)
        assert not {k for k in got if k.endswith(("load balancing loss", "z loss"))} - set(want), (name, got)


ROUTER = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
ROUTER_SETUPS = {f"{case_name(depths, detach)}_aux_z": dict(MOE, **ROUTER, mtp_num_layers=depths,
                                                             mtp_detach_heads=detach)
                 for depths, detach in CASES}
UNPADDED = dict(lengths=(5, 1, 67, 3), step=1)  # one sequence of a single token
PADDED = dict(lengths=(5, 1, 67, 3), step=4)  # each sequence padded to a multiple of 2 x CP at CP = 2
ROWS = {"unpadded": UNPADDED, "padded": PADDED}
ROUTER_LAYOUTS = {"unpadded": [dict(name="ep2_dp4", tp=1, pp=1, ep=2)],
                  "padded": [dict(name="cp2_dp2", tp=1, pp=1, ep=1, cp=2),
                             dict(name="cp2_ep2_dp2", tp=1, pp=1, ep=2, cp=2)]}


@pytest.mark.matrix
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_router_losses_on_packed_rows_match_the_reference(current, tmp_path, rows):
    """aux_loss and z-loss on packed rows: gradients and each depth's values (mtp_k load balancing
    loss, mtp_k z loss) at one rank, EP = 2 (unpadded rows) and CP = 2 (x EP = 2; padded rows)."""
    args = {"ckpt_root": str(tmp_path), "setups": ROUTER_SETUPS, **ROWS[rows]}
    (one_rank,) = launch("tests.bodies.packed_delta_net:reference", 1, args, timeout=600, build=current)
    ranks = launch("tests.bodies.packed_delta_net:layouts", 4, dict(args, layouts=ROUTER_LAYOUTS[rows]),
                   timeout=600, build=current)
    assert_moe_runs(one_rank, ranks, len(ROUTER_LAYOUTS[rows]) * len(ROUTER_SETUPS))
    for name, setup in ROUTER_SETUPS.items():  # both losses of every depth were compared
        assert len(one_rank[name]["depth_router_losses"]) == 2 * setup["mtp_num_layers"], (name, one_rank[name])


REFUSALS = {
    "seq_aux_loss": dict(setup=dict(MOE, mtp_num_layers=1, moe_router_load_balancing_type="seq_aux_loss",
                                    moe_aux_loss_coeff=0.1), **UNPADDED),
    "padding_mask": dict(setup=ROUTER_SETUPS["D1_attached_aux_z"], **UNPADDED, padding_mask=True),
}
REFUSED_WORDS = {"seq_aux_loss": ("seq_aux_loss on packed rows", "aux_loss (per micro-batch"),
                 "padding_mask": ("padding_mask", "T count every input position")}


def test_router_losses_refused_on_packed_rows(current):
    """seq_aux_loss on packed rows and router losses with upstream's padding mask: refused in one
    line before the gradient reduce (found in the forward, raised on every rank), the weights untouched."""
    (got,) = launch("tests.bodies.packed_delta_net:refusals", 1, {"cases": REFUSALS}, timeout=600, build=current)
    assert sorted(got) == sorted(REFUSALS)
    for name, result in got.items():
        message = result["message"]
        assert message is not None and "\n" not in message, (name, message)
        assert all(word in message for word in REFUSED_WORDS[name]), (name, message)
        assert result["unchanged"], name
