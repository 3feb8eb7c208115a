# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Files the Megatron-MTP fork owns inside megatron-core.

Everything under ``megatron/core/fork`` is new code, kept out of upstream files
so that the patch series in ``patches/`` stays a set of thin hooks. The install
tool links (development install) or copies (``--copy``) this directory into the
patched megatron-core; see docs/series.md, "Builds, and how fork-owned files reach megatron.core".

One folder per part of the series (each patch's header names its ``Part:``), each holding what
that part's hunks call; a module imports only from its own part or an earlier one:
runtime, upstream_fixes (part "fixes"), mtp, training_loop (part "training-loop"). ``backports``
holds what megatron-core 0.19 has upstream, which only the kept release's series (0.16.1) calls.
docs/series.md tables which fork functions each patch calls.
"""
