# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The repository itself: it tracks no build artefact, carries its license, passes its linter.

A wheel was committed at the top level once (a pyflakes wheel, by a commit about
--freeze-backbone); a fresh clone must hold sources only.
"""

import re
import subprocess
import sys

from tests.harness.launcher import REPO_ROOT

ARTEFACTS = ("*.whl", "*.tar.gz", "*.tgz", "*.zip", "*.egg", "*.so", "*.dylib", "*.o", "*.pyc", "*.pyo")


def test_no_build_artefact_is_tracked():
    tracked = subprocess.run(["git", "ls-files", "--", *ARTEFACTS], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked == [], f"build artefacts are tracked: {tracked}"


def test_the_license_and_notice_are_apache_2_0():
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    notice = (REPO_ROOT / "NOTICE").read_text()
    assert "NVIDIA" in notice and "Apache License, Version 2.0" in notice


LICENSE_HEADER = ("# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 "
                  "(LICENSE).\n# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA "
                  "CORPORATION): see NOTICE.\n")


def test_every_python_file_carries_the_license_header():
    """As megatron-core's files do: each tracked Python file opens (after a shebang) with the two
    lines saying whose it is, under which license, and that it belongs to a modified megatron-core."""
    files = subprocess.run(["git", "ls-files", "--", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    missing = []
    for name in files:
        path = REPO_ROOT / name
        if not path.exists():
            continue
        text = path.read_text()
        if text.startswith("#!"):
            text = text.split("\n", 1)[1]
        if not text.startswith(LICENSE_HEADER):
            missing.append(name)
    assert files and not missing, f"files without the license header: {missing}"


def test_every_spec_section_cited_is_in_the_repository_s_contract():
    """Docstrings and pages cite "spec section N" (or "spec sections N and M"): each N must be a
    section of docs/spec.md, which a clone has (the workspace's spec is not in a user's clone)."""
    sections = set(re.findall(r"^## (\d+)\. ", (REPO_ROOT / "docs" / "spec.md").read_text(), re.MULTILINE))
    assert sections == {str(n) for n in range(1, 13)}, sorted(sections)
    files = subprocess.run(["git", "ls-files", "--", "*.py", "*.md", "*.sh"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    cited = {}
    for name in files:
        path = REPO_ROOT / name
        if not path.exists():
            continue
        for match in re.finditer(r"spec sections? (\d+(?:(?:, | and | or |-)\d+)*)", path.read_text(errors="replace")):
            for number in re.findall(r"\d+", match.group(1)):
                cited.setdefault(number, name)
    assert cited and not set(cited) - sections, {n: f for n, f in cited.items() if n not in sections}


def test_the_tree_passes_ruff():
    """ruff.toml's rules (pyflakes, import order, lines of at most 120) on every tracked source."""
    ruff = REPO_ROOT / ".venv" / "bin" / "ruff"
    command = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    result = subprocess.run([*command, "check", "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_fork_s_folders_follow_the_series_parts_and_docs_series_tables_their_callers():
    """Each patch calls only its own part's folder of megatron/core/fork or an earlier part's,
    and so does each fork module's import; docs/series.md holds `tools/fork callers`' tables."""
    from tools.fork_tool import callers

    text = (REPO_ROOT / "docs" / "series.md").read_text()
    begin, end = "<!-- tools/fork callers: begin -->\n", "<!-- tools/fork callers: end -->"
    assert begin in text and end in text, "docs/series.md lost the markers of the callers table"
    written = text[text.index(begin) + len(begin):text.index(end)]
    versions = ("0.19.2", "0.16.1")
    for version in versions:
        assert not callers.layering_errors(version), callers.layering_errors(version)
    expected = "\n".join(callers.table(version) for version in versions)
    assert written == expected, "docs/series.md's callers table is stale: paste `tools/fork callers` for " + \
        ", ".join(versions)
    assert "`mtp.loss_branch.attach_mtp_losses`" in expected and "`runtime.device.current_device`" in expected
