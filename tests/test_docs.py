"""What the docs say about the code, checked against the code."""

import argparse
import ast

from megatron_mtp import arguments
from tests.harness.launcher import REPO_ROOT


def test_the_trainer_s_docstring_names_every_flag_it_adds():
    parser = arguments._provider({})(argparse.ArgumentParser())
    added = sorted(action.option_strings[0] for action in parser._actions if action.option_strings[0] != "-h")
    docstring = ast.get_docstring(ast.parse((REPO_ROOT / "pretrain_gpt_mtp.py").read_text()))
    assert f"adds {['no', 'one', 'two', 'three', 'four', 'five', 'six'][len(added)]} flag" in docstring, added
    assert not [flag for flag in added if flag not in docstring], added
