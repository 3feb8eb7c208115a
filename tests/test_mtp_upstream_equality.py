"""Isolation off, the fork's MTP forward equals pristine upstream megatron-core 0.16.1.

Upstream side: the pinned sdist plus only patch 0001 (device-neutral execution, without
which upstream cannot run on CPU; it does not touch MTP), imported ahead of the installed
build. Per-position MTP losses of every depth and all logits must match to 1e-6.
"""

import pytest
import torch

from megatron.training.patched_core import REPO_ROOT
from tests.harness import launch

pytestmark = pytest.mark.slow
CASES = [(1, False), (2, True), (3, False)]


@pytest.fixture(scope="module")
def captured(upstream_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("captured")
    (mine,) = launch("tests.bodies.upstream_equality:capture_cases", 1,
                     dict(out_dir=str(out), side="ours", cases=CASES))
    (upstream,) = launch("tests.bodies.upstream_equality:capture_cases", 1,
                         dict(out_dir=str(out), side="upstream", cases=CASES),
                         pythonpath_first=str(upstream_tree), check_build=False)
    return out, mine, upstream


def test_each_side_ran_its_own_megatron_core(captured, upstream_tree):
    _, mine, upstream = captured
    assert mine["core"].startswith(str(REPO_ROOT / ".build" / "install"))
    assert upstream["core"].startswith(str(upstream_tree))


@pytest.mark.parametrize("depths,tied", CASES)
def test_isolation_off_forward_equals_upstream(captured, depths, tied):
    out, _, _ = captured
    name = f"D{depths}-{'tied' if tied else 'untied'}"
    a, b = torch.load(out / f"ours-{name}.pt"), torch.load(out / f"upstream-{name}.pt")
    assert len(a["mtp_losses"]) == len(b["mtp_losses"]) == depths
    for key in ("mtp_losses", "logits", "main"):
        assert torch.allclose(torch.tensor(a[key]), torch.tensor(b[key]), rtol=0, atol=1e-6), key
