# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Switch megatron-core's model-parallel layout inside a running launch."""

import contextlib

from megatron.core import parallel_state

from megatron_mtp.library.initialize import initialize_model_parallel


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, ep: int = 1, *,
                   pipeline_layout: str | None = None, tied_embeddings: bool | None = None, cp: int = 1):
    """The trainer's TP x CP x PP (x VPP) x DP (x EP) setup for the body's block, torn down
    afterwards (an upstream pipeline layout and its word-embedding group as the library's
    initialize_model_parallel takes them)."""
    initialize_model_parallel(tp, pp, vpp, seed, ep, pipeline_layout=pipeline_layout, tied_embeddings=tied_embeddings,
                              cp=cp)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
