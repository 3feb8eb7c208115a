# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Backports: what megatron-core 0.19 has upstream, for the 0.16.1 series, which alone uses them.

Each gives 0.16.1 what megatron-core 0.19 has upstream, with the same parameter names,
attributes and results, so that both series train the same objective:

- isolation: the backbone boundary, the detached depth embedding and the MTP gradient-norm
  tag of ``mtp_detach_heads`` (0.19: upstream's MTP block and GPTModel);
- repeated: one MTP layer applied at every depth (``mtp_use_repeated_layer``);
- recompute: activation recompute of an MTP layer with packed (THD) sequences;
- grad_norm_groups: each gradient-norm group measured and clipped by its own norm.
- options: TransformerConfig's base with the two MTP options 0.17 added upstream.

Nothing else imports them; what differs between the carried versions at run time goes
through megatron.core.fork.runtime.compat.
"""
