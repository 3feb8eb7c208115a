# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""verl 0.9.1's own Megatron engine step (MegatronEngineWithLMHead.train_batch: forward_backward_batch and
its optimizer step) on gloo ranks run by .venv-verl (tools/bootstrap --framework verl), with the verl
series (patches/verl-0.9.1/) and without its step patch (tests/bodies/verl_engine.py).

With the series every copy of every gradient equals the reference's (verl's main loss on the whole global
batch plus the spec's (lambda / D) sum_k S_k / N_tok) when forward_backward_batch returns, and the same
mini-batch cut into other micro-batches gives the same gradients: verl's default regime in BSHD and THD,
its per-token regime (THD), detach_encoder as the spec's detached heads, D = 1 and 2; the optimizer step
runs; verl's mtp_losses/mtp_k_loss are the reference's per-depth losses, and the acceptances come on a
logged step only. Without the step patch (the series' other patches applied to a copy of verl's package)
the same steps give verl's own figure: gradients far from the reference and apart between cuts. A
mini-batch that counts a sequence's first token, and an override that contradicts detach_encoder, are
refused in one line, nothing changed.

Default tier: DP = 2 on two ranks (with and without the step patch), PP = 2 x DP = 2 on four. Matrix
tier: TP = 2 x DP = 2 (sequence parallel, as verl's engine config sets it with TP) on four.
"""

import shutil
import sys
from pathlib import Path

import pytest

from tests.harness import launch, verl_env
from tests.harness.launcher import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
from fork_tool import installed  # noqa: E402
from fork_tool.git import init_pristine  # noqa: E402
from fork_tool.series import PRISTINE_TAG, apply_series  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 1e-5


def case(name, data_format, micro_batch, depths=2, per_token=False, detach_encoder=False, logged=False) -> dict:
    return {"name": name, "format": data_format, "micro_batch": micro_batch, "depths": depths,
            "per_token": per_token, "detach_encoder": detach_encoder, "logged": logged}


# each data-parallel rank holds 4 sequences: micro-batches of 1, 2 or all 4 of them
CASES = [case("bshd_mb1", "bshd", 1), case("bshd_mb2", "bshd", 2, logged=True),
         case("thd_mb1", "thd", 1), case("thd_mb4", "thd", 4),
         case("thd_per_token_mb1", "thd", 1, per_token=True), case("thd_per_token_mb2", "thd", 2, per_token=True),
         case("thd_detached_d1_mb2", "thd", 2, depths=1, detach_encoder=True),
         case("thd_detached_per_token_mb1", "thd", 1, per_token=True, detach_encoder=True)]
PAIRS = [("bshd_mb1", "bshd_mb2"), ("thd_mb1", "thd_mb4"), ("thd_per_token_mb1", "thd_per_token_mb2"),
         ("bshd_mb1", "thd_mb4")]
# without the step patch: verl's own normalization in both regimes, cut two ways
WITHOUT = [c for c in CASES if c["name"] in ("bshd_mb1", "bshd_mb2", "thd_per_token_mb1", "thd_per_token_mb2")]
WITHOUT_PAIRS = [("bshd_mb1", "bshd_mb2"), ("thd_per_token_mb1", "thd_per_token_mb2")]
# on four ranks: each layout with DP = 2 (the same rank shares), both regimes
LAYOUTS = [("pp2_dp2", 1, 2)]
MATRIX_LAYOUTS = [("tp2_dp2", 2, 1)]
LAYOUT_CASES = [c for c in CASES if c["name"] in ("bshd_mb2", "thd_per_token_mb1", "thd_detached_d1_mb2")]


def series_without_step_patch(destination: Path) -> Path:
    """A copy of .venv-verl's verl package with the series applied except its step patch (0003): the
    others from the wheel's pristine files, as tools/fork framework applies them."""
    wanted = installed.pin("framework")
    env = installed.Environment(str(verl_env.python()), wanted)
    patches = wanted.patches()
    kept = [patch for patch in patches if "exact-MTP-steps" not in patch.name]
    assert len(kept) == len(patches) - 1, [p.name for p in patches]
    shutil.copytree(env.root / "verl", destination / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    scratch = destination.parent / "scratch"
    paths = installed.touched(patches)
    for path, kind in paths.items():
        data = env.pristine(path, kind)
        if data is not None:
            (scratch / path).parent.mkdir(parents=True, exist_ok=True)
            (scratch / path).write_bytes(data)
    init_pristine(scratch, PRISTINE_TAG)
    assert all(status == "ok" for _, status in apply_series(scratch, kept))
    for path in paths:
        installed.put(destination / path, installed.read(scratch / path))
    return destination


def verl_launch(world_size: int, args: dict, first_on_path: Path | None = None) -> list:
    verl_env.need()
    return launch("tests.bodies.verl_engine:suite", world_size, args, timeout=900, python=str(verl_env.python()),
                  first_on_path=first_on_path)


@pytest.fixture(scope="module")
def with_series(tmp_path_factory):
    return verl_launch(2, {"ckpt_root": str(tmp_path_factory.mktemp("verl")), "cases": CASES,
                           "layouts": [("dp2", 1, 1)], "pairs": PAIRS, "refusals": True})


@pytest.fixture(scope="module")
def without_step_patch(tmp_path_factory):
    verl_env.need()
    tree = series_without_step_patch(tmp_path_factory.mktemp("verl-without-step") / "site")
    return verl_launch(2, {"ckpt_root": str(tmp_path_factory.mktemp("verl-without")), "cases": WITHOUT,
                           "layouts": [("dp2", 1, 1)], "pairs": WITHOUT_PAIRS}, first_on_path=tree)


def test_every_gradient_is_the_reference_s_and_the_same_however_the_step_is_cut(with_series):
    for rank in with_series:
        results = rank["layouts"]
        for c in CASES:
            result = results[f"dp2/{c['name']}"]
            assert result["rel"] < TOL and result["moved"], (c["name"], result["rel"], result["moved"])
        for a, b in PAIRS:
            assert results[f"dp2/{a}~{b}"] < TOL, (a, b, results[f"dp2/{a}~{b}"])


def test_without_the_step_patch_verl_s_own_figure(without_step_patch):
    """verl's own normalization, the same steps: far from the reference and apart between two cuts of one
    mini-batch, in both regimes (per-token: sequences whose first targets lie within D positions of
    their start)."""
    for rank in without_step_patch:
        results = rank["layouts"]
        for c in WITHOUT:
            assert results[f"dp2/{c['name']}"]["rel"] > 1e-2, (c["name"], results[f"dp2/{c['name']}"]["rel"])
        for a, b in WITHOUT_PAIRS:
            assert results[f"dp2/{a}~{b}"] > 1e-2, (a, b, results[f"dp2/{a}~{b}"])


def test_verl_s_mtp_metrics_are_the_step_s(with_series):
    """mtp_losses/mtp_k_loss on every step, equal to the reference's S_k / M_k over the global batch; the
    acceptances (mtp_acceptance/...) on the step verl logs (bshd_mb2) and on no other."""
    for rank in with_series:
        for c in CASES:
            result = rank["layouts"][f"dp2/{c['name']}"]
            metrics, losses = result["metrics"], result["reference losses"]
            for k, want in enumerate(losses, start=1):
                (got,) = metrics[f"mtp_losses/mtp_{k}_loss"]
                assert abs(got - want) <= TOL * want, (c["name"], k, got, want)
            acceptances = sorted(key for key in metrics if key.startswith("mtp_acceptance/"))
            if c["logged"]:
                assert {"mtp_acceptance/mtp_1_acceptance", "mtp_acceptance/mtp_2_chain_acceptance",
                        "mtp_acceptance/mtp_2_sampled_acceptance", "mtp_acceptance/expected_accepted_length"
                        } <= set(acceptances), acceptances
                assert all(0.0 <= metrics[key][0] <= 1.0 for key in acceptances if "length" not in key)
            else:
                assert acceptances == [], (c["name"], acceptances)


def test_bad_input_is_refused_in_one_line_and_changes_nothing(with_series):
    for rank in with_series:
        refused = rank["first token target"]
        assert "count their first token as a target" in (refused["message"] or ""), refused
        assert "\n" not in refused["message"] and refused["params"] and refused["grads_zero"], refused
        override = rank["contradicting override"]
        assert override and "contradicts mtp.detach_encoder=False" in override and "\n" not in override


def check_layouts(tmp_path, layouts: list) -> None:
    ranks = verl_launch(4, {"ckpt_root": str(tmp_path), "cases": LAYOUT_CASES, "layouts": layouts, "pairs": []})
    for rank in ranks:
        for layout, *_ in layouts:
            for c in LAYOUT_CASES:
                result = rank["layouts"][f"{layout}/{c['name']}"]
                assert result["rel"] < TOL and result["moved"], (layout, c["name"], result["rel"])


def test_pipeline_parallel_layout(tmp_path):
    check_layouts(tmp_path, LAYOUTS)


@pytest.mark.matrix
def test_tensor_parallel_layout(tmp_path):
    check_layouts(tmp_path, MATRIX_LAYOUTS)
