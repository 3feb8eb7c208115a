"""The repository itself: it tracks no build artefact, and carries its license.

A wheel was committed at the top level once (a pyflakes wheel, by a commit about
--freeze-backbone); a fresh clone must hold sources only.
"""

import subprocess

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
