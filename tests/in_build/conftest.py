# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Unit tests that import megatron-core in the test process itself. tests/test_in_build.py
runs this directory once per carried build, with that build first on the path."""

import os

from megatron_mtp.patched_core import require_patched_core


def pytest_sessionstart(session):
    require_patched_core(os.environ["MEGATRON_MTP_BUILD"])
