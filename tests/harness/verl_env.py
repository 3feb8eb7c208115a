# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""verl's environment (tools/bootstrap --framework verl): the interpreter its tests' ranks run."""

import os
from pathlib import Path

import pytest

from megatron_mtp.patched_core import REPO_ROOT


def python() -> Path:
    """verl's interpreter: $MEGATRON_MTP_VERL_PYTHON, else this checkout's .venv-verl."""
    return Path(os.environ.get("MEGATRON_MTP_VERL_PYTHON") or REPO_ROOT / ".venv-verl" / "bin" / "python")


def need() -> None:
    """Fail (not skip) without it, naming the setup command."""
    if not (python().is_file() and os.access(python(), os.X_OK)):
        pytest.fail(f"no verl at {python()}: run `bash tools/bootstrap --framework verl`")
