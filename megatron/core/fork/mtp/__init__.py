# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Exact MTP training: what the patched GPTModel and MTP block call into.

- options: validation of the MTP flags on TransformerConfig.
- isolation: gradient isolation of the MTP heads (``mtp_detach_heads``).
- supervision: per-depth targets and masks, labels derived from input ids.
- statistics: exact per-depth sums and counts (loss, acceptance, chain acceptance).
- heads: the per-depth loss branch of GPTModel's postprocess.
- sparse_loss: that branch at the needed rows only, in chunks (``mtp_sparse_loss``).
- last_depth: the last depth's MLP at the rows its loss reads (with ``mtp_sparse_loss``).
"""
