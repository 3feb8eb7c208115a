"""The fork-owned modules become part of megatron-core (megatron/core/fork), which users of
the 0.16.1 series run on Python 3.10: they must not need anything newer."""

import ast

from megatron_mtp.patched_core import FORK_OWNED_DIR

NEWER_THAN_3_10 = {"tomllib"}  # standard-library modules added after 3.10 (3.11: tomllib)


def test_fork_owned_modules_parse_as_python_3_10():
    sources = sorted(FORK_OWNED_DIR.rglob("*.py"))
    assert sources
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & NEWER_THAN_3_10, (path, imported & NEWER_THAN_3_10)
