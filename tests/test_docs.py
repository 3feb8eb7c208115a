# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What the docs say about the code, checked against the code."""

import argparse
import ast
import re

from megatron_mtp.arguments import defaults
from tests.harness.launcher import REPO_ROOT


def test_the_trainer_s_docstring_names_every_flag_it_adds():
    parser = defaults.provider({})(argparse.ArgumentParser())
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


def _code_map() -> str:
    return (REPO_ROOT / "docs" / "code-map.md").read_text()


def test_every_path_the_code_map_names_exists():
    """docs/code-map.md says where a change goes and which tests guard it; a path that moved or a
    test file that was renamed makes it false. Every word in backticks that is a repository path
    (it has a "/" or a file suffix; commands' flags and Python names are not) must exist, a
    `<placeholder>` or a `*` matching at least one file; every test file the page names must exist."""
    text = _code_map()
    words = {word for span in re.findall(r"`([^`]+)`", text) for word in span.split()}
    paths = {word for word in words
             if not word.startswith("-") and ("/" in word or re.search(r"\.(py|md|sh|toml)$", word))}
    missing = [path for path in sorted(paths)
               if not list(REPO_ROOT.glob(re.sub(r"(<[^>]+>|\*)+", "*", path).rstrip("/")))]
    assert len(paths) > 100 and not missing, f"docs/code-map.md names paths that do not exist: {missing}"
    tests = set(re.findall(r"\btest_\w+\.py\b", text))
    absent = sorted(name for name in tests if not list((REPO_ROOT / "tests").glob(f"**/{name}")))
    assert tests and not absent, f"docs/code-map.md names test files that do not exist: {absent}"


def test_the_code_map_places_every_test_file():
    """A new test file gets its row in docs/code-map.md (the change it guards), so that the map
    answers "which test guards it" for every test there is."""
    named = set(re.findall(r"`(tests/(?:in_build/)?test_\w+\.py)`", _code_map()))
    files = {path.relative_to(REPO_ROOT).as_posix()
             for pattern in ("tests/test_*.py", "tests/in_build/test_*.py") for path in REPO_ROOT.glob(pattern)}
    assert files and not files - named, f"docs/code-map.md places no row for {sorted(files - named)}"
