"""HybridModel, upstream's successor of GPTModel, trains MTP exactly through the same fork hooks
(issue 18): a hybrid pattern that is the GPT network ("*-" per layer: attention layer, then MLP
layer; "/*-" per MTP depth) on the GPT's weights gives the plain-PyTorch reference's main loss,
MTP loss, per-depth statistics (counts exact) and every parameter's gradient, for D in {1, 2},
isolation off and on, sparse and dense MTP loss. Upstream's HybridModel normalizes each depth
by a local count (process_mtp_loss, #7452) and fails it.

Tolerance: relative 1e-5 of each compared tensor's largest magnitude (float32 round-off).
0.16.1's hybrid model predates the pattern's MTP part: 0.19.2 only.
"""

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def cases(build):
    if build != "0.19.2":
        pytest.skip("HybridModel's MTP depths (the pattern's '/' parts) exist from megatron-core 0.19")
    (result,) = launch("tests.bodies.hybrid:gpt_equivalence", 1, {}, timeout=600, build=build)
    return result


def test_a_gpt_shaped_hybrid_pattern_matches_the_reference(cases):
    assert len(cases) == 8
    for name, errors in cases.items():
        assert "error" not in errors, (name, errors)
        assert errors["same_parameters"] and errors["grad_names"], (name, errors)
        assert errors["counts_exact"], (name, errors)
        for key in ("main_ce", "mtp_loss", "grads", "sums"):
            assert errors[key] < TOL, (name, key, errors[key])
