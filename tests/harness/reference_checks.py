# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What each result of tests/bodies/mtp_model.py's compare_case must hold: every one of its checks
for the case's depths and MTP loss path, each passed. A check that goes missing or returns
anything but True (a flag) or a float within the tolerance (an error) fails: None does not pass."""

import re

FLAGS = ("grad_names", "counts_exact")
ERRORS = ("main_logits", "main_ce", "grads", "sums")
# A compare_case name holds the depths ("D2-") and ends with the MTP loss path ("-sparse" or "-dense").
_NAME = re.compile(r"(?:^|-)D(\d+)-.*-(sparse|dense)$")


def expected_checks(depths: int, sparse: bool) -> dict:
    """Check name -> bool (a flag) or float (a relative error)."""
    if sparse:  # one MTP loss term for every depth, no dense MTP logits
        mtp = {"mtp_logits_never_dense": bool, "mtp_loss": float}
    else:
        mtp = {f"mtp{k}_{part}": float for k in range(1, depths + 1) for part in ("logits", "loss")}
    return {**dict.fromkeys(FLAGS, bool), **dict.fromkeys(ERRORS, float), **mtp}


def failed_checks(name: str, errors: dict, tol: float) -> dict:
    """The checks of case `name` that are missing, unexpected or not passed (empty: all passed)."""
    match = _NAME.search(name)
    assert match, f"not a compare_case name: {name}"
    expected = expected_checks(int(match[1]), match[2] == "sparse")
    failed = {key: "missing" for key in expected.keys() - errors.keys()}
    failed.update({key: f"unexpected: {errors[key]!r}" for key in errors.keys() - expected.keys()})
    for key, kind in expected.items():
        value = errors.get(key)
        passed = value is True if kind is bool else type(value) is float and value <= tol
        if key in errors and not passed:
            failed[key] = value
    return failed
