# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What the docs say about the code, checked against the code."""

import argparse
import ast
import re

from megatron_mtp import arguments
from tests.harness.launcher import REPO_ROOT


def test_the_trainer_s_docstring_names_every_flag_it_adds():
    parser = arguments._provider({})(argparse.ArgumentParser())
    added = sorted(action.option_strings[0] for action in parser._actions if action.option_strings[0] != "-h")
    docstring = ast.get_docstring(ast.parse((REPO_ROOT / "pretrain_gpt_mtp.py").read_text()))
    assert f"adds {['no', 'one', 'two', 'three', 'four', 'five', 'six'][len(added)]} flag" in docstring, added
    assert not [flag for flag in added if flag not in docstring], added


def test_the_main_command_s_final_validation_is_quoted_alike():
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    mtp_1, mtp_2 = re.search(r"on the validation set, mtp_1 acceptance (\d\.\d+), mtp_2 acceptance (\d\.\d+)",
                             readme).groups()
    measurements = (REPO_ROOT / "docs" / "measurements.md").read_text()
    (row,) = [line for line in measurements.splitlines() if line.startswith("| its final validation |")]
    assert re.search(r"mtp_1 acceptance (\d\.\d+), mtp_2 (\d\.\d+)", row).groups() == (mtp_1, mtp_2), row
    serving = " ".join((REPO_ROOT / "docs" / "serving.md").read_text().split())
    assert f"final validation (the README's) gives mtp_1 {mtp_1}, mtp_2 {mtp_2}" in serving
    quoted = re.findall(r"final validation mtp_1 / mtp_2 acceptance (\d\.\d+) / (\d\.\d+)", readme)
    assert all(pair == (mtp_1, mtp_2) for pair in quoted), quoted
