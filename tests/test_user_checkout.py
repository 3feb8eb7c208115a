# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The trainer from a user's own Megatron-LM checkout (issue 16): `tools/fork export --for-users`
carries pretrain_gpt_mtp.py and megatron_mtp as its last patch, so after `git am` of the
exported series the user runs `torchrun pretrain_gpt_mtp.py` from that checkout, on its own
megatron (not this project's build), and gets this checkout's steps. A checkout the series was
not applied to is refused in one line.

The checkout is the pristine sdist of the current version (a Megatron-LM checkout at that tag
has the same megatron/ paths). Its C++ dataset helpers are not built for the Python that runs
the trainer (upstream's first-use `make` compiles them with the system's python3-config and
pybind11): the trainer refuses in one line that names the command building them for its
Python, and the test runs that command, as the user would, before training.
"""

import subprocess
import sys

import pytest

from megatron_mtp.patched_core import (
    BUILD_DIR,
    EXPORT_MARK,
    REPO_ROOT,
    current_upstream_version,
    expected_build_version,
)
from tests.harness.checkout import GIT, applied_checkout, pristine_checkout
from tests.harness.trainer import TINY, scalars, train

CURRENT = current_upstream_version()
SDIST = BUILD_DIR / "downloads" / f"megatron_core-{CURRENT}.tar.gz"
ARGS = (*TINY, "--mtp-num-layers", "2", "--train-iters", "3", "--eval-interval", "1000", "--save-interval", "1000")
COMPARED = ("lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm")


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """What `tools/fork export --for-users` writes for the current version."""
    out = tmp_path_factory.mktemp("export") / "series"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "fork"), "export", "--for-users", str(out),
                    "--sdist", str(SDIST)], check=True, capture_output=True, cwd=REPO_ROOT)
    return out


def test_the_exported_series_runs_the_trainer_from_a_megatron_lm_checkout(series, tmp_path):
    tree = applied_checkout(series, SDIST, tmp_path / "user")
    error = refusal(tree)
    assert "the C++ dataset helpers (megatron/core/datasets/helpers.cpp) are not built for this Python" in error
    command = error.split("build them with `", 1)[1].rsplit("`", 1)[0]
    built = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    probe = subprocess.run(
        [sys.executable, "-c", "import megatron.core.fork, megatron.training, megatron_mtp, pretrain_gpt_mtp as t\n"
         "print(megatron.core.fork.__file__, megatron.training.__file__, megatron_mtp.__file__, t.__file__)"],
        cwd=tree, capture_output=True, text=True, check=True)
    imported = probe.stdout.split()
    assert len(imported) == 4 and all(path.startswith(str(tree)) for path in imported), imported

    runs = {}
    for name, cwd in (("this checkout", REPO_ROOT), ("user's checkout", tree)):
        logs = tmp_path / f"tb-{len(runs)}"
        run = train(2, *ARGS, "--save", str(tmp_path / f"ckpt-{len(runs)}"), "--tensorboard-dir", str(logs),
                    cwd=cwd)
        assert "mtp_2 chain acceptance" in run.output
        runs[name] = scalars(logs)
    want, got = runs["this checkout"], runs["user's checkout"]
    for tag in COMPARED:
        assert sorted(want[tag]) == sorted(got[tag]) == [1, 2, 3], tag
        for step in (1, 2, 3):  # the same code on the same samples: the same numbers, bit for bit
            assert got[tag][step] == want[tag][step], (tag, step, got[tag][step], want[tag][step])


def refusal(tree) -> str:
    """The one error line pretrain_gpt_mtp.py prints in `tree` (and that it exits non-zero)."""
    result = subprocess.run([sys.executable, "pretrain_gpt_mtp.py"], cwd=tree, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1, errors
    return errors[0]


def test_a_checkout_without_the_series_is_refused_in_one_line(series, tmp_path):
    """Only the export's last patch (the trainer) applied: the checkout's megatron.core lacks the
    series (a pristine 0.19.2 does not even import on Python 3.11: it is found by path). The
    trainer copied without that patch's mark (not from an export) is refused too."""
    tree = pristine_checkout(SDIST, tmp_path / "user")
    trainer = series / (series / "series").read_text().split()[-1]
    subprocess.run([*GIT, "am", "-q", str(trainer)], cwd=tree, check=True, capture_output=True)
    error = refusal(tree)
    assert "does not carry the Megatron-MTP series" in error and "tools/fork export --for-users" in error, error
    assert f"megatron-core {expected_build_version(CURRENT)}" in error, error

    (tree / EXPORT_MARK).unlink()
    error = refusal(tree)
    assert "neither a Megatron-MTP checkout" in error and "tools/bootstrap" in error, error
