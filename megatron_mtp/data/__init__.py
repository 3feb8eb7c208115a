# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Data for pretrain_gpt_mtp.py: tokenizers from local files, megatron-core indexed datasets
with a metadata file, and the embedded default corpus."""
