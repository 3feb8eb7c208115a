# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The suite's two tiers (docs/tests.md): the default tier keeps a case of every dimension, --matrix
adds the rest, and a skip outside the allow-list fails the run."""

import os
import subprocess
import sys

import pytest

from tests import conftest
from tests.harness.launcher import REPO_ROOT


def collected(*options: str) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *options], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_the_default_tier_keeps_a_case_of_every_dimension_and_the_matrix_adds_the_rest():
    default, everything = collected(), collected("--matrix")
    assert set(default) < set(everything)
    assert len(set(everything) - set(default)) >= 100  # the cross-product behind --matrix
    dimensions = {
        "current build": "[core0.19.2",
        "older build": "[core0.16.1",
        "layout families": "test_layout_matches_one_process[core0.19.2-pp4_vpp2_mtp_stage",
        "tensor x pipeline": "test_layout_matches_one_process[core0.19.2-tp2_pp2",
        "distributed optimizer": "dp4_distributed_optimizer",
        "MoE": "tests/test_trainer_moe.py::",
        "MoE gradients on the older build": "test_moe_gradients.py::test_one_rank_matches_the_reference[core0.16.1",
        "HybridModel": "tests/test_trainer_hybrid.py::",
        "serving": "tests/test_serving.py::",
        "Slurm": "tests/test_slurm.py::",
        "the user checkout": "tests/test_user_checkout.py::",
        "faults": "tests/test_trainer_faults.py::",
        "the series on every version": "test_check_applies_every_patch_to_pristine_upstream[0.16.1]",
    }
    missing = [name for name, part in dimensions.items() if not any(part in nodeid for nodeid in default)]
    assert not missing, missing
    assert not any("test_the_time_limit_checkpoints_requeues" in nodeid for nodeid in default)


def test_only_allow_listed_skips_pass():
    assert conftest._allowed_skip("tests/test_gpu.py::test_bf16_trains", "needs a CUDA device (CPU-only machine)")
    assert conftest._allowed_skip("tests/test_hybrid_model.py::test_a_gpt_shaped_hybrid_pattern_matches_the_reference"
                                  "[core0.16.1]", "HybridModel's MTP depths (the pattern's '/' parts) exist from "
                                  "megatron-core 0.19")
    assert not conftest._allowed_skip("tests/test_hybrid_model.py::test_a_gpt_shaped_hybrid_pattern_matches_the_"
                                      "reference[core0.19.2]", "HybridModel's MTP depths exist from megatron-core 0.19")
    assert not conftest._allowed_skip("tests/test_serving.py::test_round_trips_are_bit_identical",
                                      "could not import 'transformers': No module named 'transformers'")


def run_probes(directory, *options: str) -> subprocess.CompletedProcess:
    # -p loads the project's conftest as a plugin before pytest.ini's pythonpath applies
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tools")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           *options, str(directory)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


# A test file turned off by a missing package: at import (the whole file skips at collection, before any
# test's report), or in its test; and the skip line the run must print for it.
SKIPPED_PROBES = {
    "module": ("import pytest\n\npytest.importorskip('a_package_that_is_not_installed')\n\n\n"
               "def test_turned_off():\n    pass\n", "test_probe_off.py: could not import"),
    "test": ("import pytest\n\n\ndef test_turned_off():\n    pytest.importorskip('a_package_that_is_not_installed')\n",
             "test_probe_off.py::test_turned_off: could not import"),
}


@pytest.mark.parametrize("where", SKIPPED_PROBES)
def test_a_skip_outside_the_allow_list_fails_the_run(tmp_path, where):
    """What a missing package did to the serving tests (a module-level importorskip): now the run
    fails, naming the skipped file or test; with pytest-xdist too (the README's command)."""
    (tmp_path / "test_probe_kept.py").write_text("def test_kept():\n    pass\n")
    source, line = SKIPPED_PROBES[where]
    (tmp_path / "test_probe_off.py").write_text(source)
    for options in ((), ("-n", "2", "--dist", "loadfile")):
        result = run_probes(tmp_path, *options)
        said = (options, result.stdout[-2000:])
        assert result.returncode == 1 and "skips outside the allow-list" in result.stdout, said
        assert line in result.stdout, said


def test_a_run_without_skips_passes(tmp_path):
    (tmp_path / "test_probe_kept.py").write_text("def test_kept():\n    pass\n")
    result = run_probes(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:]
