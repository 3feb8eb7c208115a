# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The fork-owned modules become part of megatron-core (megatron/core/fork), which users of
the 0.16.1 series run on Python 3.10: they must not need anything newer."""

import ast
import re

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


def test_the_0_16_1_only_modules_are_fenced():
    """megatron/core/fork/backports holds what only the 0.16.1 series calls: no other fork
    module and no hunk of another series imports it, and the 0.16.1 series imports each."""
    from megatron_mtp.patched_core import carried_versions, series_patches

    fenced = FORK_OWNED_DIR / "backports"
    outside = [p for p in FORK_OWNED_DIR.rglob("*.py") if fenced not in p.parents]
    importing = re.compile(r"^\s*(from|import)\s+\S*backports", re.M)
    assert outside and not [p for p in outside if importing.search(p.read_text())]
    added = {version: "\n".join(line for patch in series_patches(version) for line in patch.read_text().splitlines()
                                if line.startswith("+") and not line.startswith("+++"))
             for version in carried_versions()}
    assert "0.16.1" in added and len(added) > 1
    for version, lines in added.items():
        for module in sorted(p.stem for p in fenced.glob("*.py") if p.stem != "__init__"):
            used = re.search(rf"backports(\.| import ){module}\b", lines) is not None
            assert used == (version == "0.16.1"), (version, module)
