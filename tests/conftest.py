import subprocess
import tarfile

import pytest
import torch


def pytest_sessionstart(session):
    """Every test needs this checkout's patched megatron-core; say how to get it, once."""
    from megatron.training.patched_core import PatchedCoreError, require_patched_core

    try:
        require_patched_core()
    except PatchedCoreError as error:
        raise pytest.UsageError(str(error))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CPU-only machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def upstream_tree(tmp_path_factory):
    """Pristine upstream megatron-core plus only patch 0001 (device-neutral execution, which
    upstream needs to run on CPU and which touches no MTP or normalization code), to import
    ahead of the installed build (launch(..., pythonpath_first=...))."""
    from megatron.training.patched_core import FORK_OWNED_DIR, REPO_ROOT, current_upstream_version, series_patches

    version = current_upstream_version()
    sdist = REPO_ROOT / ".build" / "downloads" / f"megatron_core-{version}.tar.gz"
    root = tmp_path_factory.mktemp("upstream")
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    (tree,) = root.iterdir()
    device_patch = series_patches(version)[0]
    assert "CUDA" in device_patch.name  # the device-neutral patch, and nothing else
    subprocess.run(["git", "apply", str(device_patch)], cwd=tree, check=True)
    (tree / "megatron" / "core" / "fork").symlink_to(FORK_OWNED_DIR)
    return tree
