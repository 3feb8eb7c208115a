import os

import pytest
import torch

from fork_tool.series import make_upstream_tree
from megatron_mtp.patched_core import build_tree, carried_versions, expected_build_version

# Every carried upstream version (a series in patches/), newest first. Tests that run
# megatron-core take a `build` (the version) and launch their bodies on that build.
BUILDS = carried_versions()
# tests/in_build runs in its own process per build (tests/test_in_build.py).
collect_ignore = [] if os.environ.get("MEGATRON_MTP_BUILD") else ["in_build"]


def pytest_sessionstart(session):
    """Every carried version must be built from this checkout's series; say how, once."""
    missing = [v for v in BUILDS if not (build_tree(v) / "megatron" / "core" / "fork").exists()]
    if missing:
        raise pytest.UsageError(
            f"no build of megatron-core {', '.join(expected_build_version(v) for v in missing)}: "
            "run `bash tools/bootstrap` (or `tools/fork install && tools/fork build --all`)"
        )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CPU-only machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", params=BUILDS, ids=[f"core{v}" for v in BUILDS])
def build(request) -> str:
    """The upstream version whose patched build a test module runs on (each carried one)."""
    return request.param


@pytest.fixture(scope="module")
def upstream_tree(build, tmp_path_factory):
    """Pristine upstream megatron-core of `build` plus only the series' runtime part, which makes
    it run here (CPU/gloo, Python 3.11; it touches no MTP or normalization code), to launch bodies on
    (launch(..., upstream_tree=...))."""
    return make_upstream_tree(build, tmp_path_factory.mktemp(f"upstream-{build}"))
