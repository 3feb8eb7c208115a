"""MTP gradients, group norms and metrics are the same on TP=2, PP=2 (MTP on the last
stage) and DP=2 layouts as in one process (spec section 4's invariance, model side):
every copy of every parameter's full gradient, the group norms, loss and per-depth sums.

Data: loss-mask holes and very uneven valid-token counts across samples and therefore
across data-parallel ranks. Tolerance: relative 1e-5 of each parameter's largest gradient
magnitude (float32 round-off); valid, correct and chain-correct counts exact.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5
# Model setups, each run on every layout (kwargs of tests.bodies.tiny_gpt.Setup).
SETUPS = {
    "attached_D2": dict(mtp_num_layers=2),
    "isolated_D2_repeated": dict(mtp_num_layers=2, mtp_detach_heads=True, mtp_use_repeated_layer=True),
    "isolated_D3": dict(mtp_num_layers=3, mtp_detach_heads=True),
    # Tied: under PP the MTP stage holds the embedding copy that also serves as output weight.
    "attached_D2_tied": dict(mtp_num_layers=2, tied=True),
}
LAYOUTS = [dict(name="tp2_dp2", tp=2, pp=1), dict(name="pp2_dp2", tp=1, pp=2), dict(name="tp2_pp2", tp=2, pp=2),
           dict(name="dp4_distributed_optimizer", tp=1, pp=1, distributed_optimizer=True)]


@pytest.fixture(scope="module")
def runs(build, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mtp-ckpt"))
    (reference,) = launch("tests.bodies.mtp_layouts:reference", 1, {"ckpt_root": root, "setups": SETUPS},
                          timeout=600, build=build)
    ranks = launch("tests.bodies.mtp_layouts:layouts", 4, {"ckpt_root": root, "layouts": LAYOUTS, "setups": SETUPS},
                   timeout=600, build=build)
    return reference, ranks


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def cases():
    return [(layout["name"], setup) for layout in LAYOUTS for setup in SETUPS]


@pytest.mark.parametrize("layout,setup", cases())
def test_layout_matches_one_process(runs, layout, setup):
    reference, ranks = runs
    want = reference[setup]
    for got in (rank[f"{layout}/{setup}"] for rank in ranks):
        # (distributed optimizer: the reduced shards of every rank gathered into full gradients)
        assert got["grads_rel"] < TOL, got["grads_rel"]
        assert got["grad norms"].keys() == want["grad norms"].keys()
        for group, norm in want["grad norms"].items():
            assert rel(got["grad norms"][group], norm) < TOL, group
        assert rel(got["lm loss"], want["lm loss"]) < TOL
        assert len(got["mtp sums"]) == len(want["mtp sums"]) == SETUPS[setup]["mtp_num_layers"]
        for got_row, want_row in zip(got["mtp sums"], want["mtp sums"]):
            assert rel(got_row[0], want_row[0]) < TOL  # CE sum
            assert got_row[1:] == want_row[1:]  # valid, correct, chain-correct counts: exact
        for key in want:
            if key.startswith("mtp_") or key.startswith("expected"):
                assert rel(got[key], want[key]) < TOL, key


def test_isolation_reports_a_separate_mtp_norm(runs):
    reference, _ = runs
    assert set(reference["attached_D2"]["grad norms"]) == {"main"}
    assert set(reference["isolated_D3"]["grad norms"]) == {"main", "mtp"}
    assert reference["isolated_D3"]["grad norm"] == reference["isolated_D3"]["grad norms"]["main"]


def test_each_group_is_measured_and_clipped_by_its_own_norm(runs):
    """Independent norms of the gradients by group; clip_grad = 1 clips the main group
    (norm > 1) to 1 and leaves the small MTP group untouched (one global norm would
    shrink both)."""
    reference, _ = runs
    result = reference["isolated_D3"]
    before, after = result["independent_group_norms"]["before_clip"], result["independent_group_norms"]["after_clip"]
    assert rel(result["grad norms"]["main"], before["main"]) < TOL
    assert rel(result["grad norms"]["mtp"], before["mtp"]) < TOL
    assert before["main"] > 1.0 > before["mtp"] > 0
    assert rel(after["main"], 1.0) < TOL
    assert rel(after["mtp"], before["mtp"]) < TOL
