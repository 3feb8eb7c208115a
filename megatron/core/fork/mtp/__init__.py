# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Part "mtp": exact MTP training in megatron-core, what the patched GPTModel, HybridModel and
MTP block call into, and the step that normalizes every loss branch exactly.

- options: validation of the MTP flags on TransformerConfig.
- isolation: gradient isolation of the MTP heads (``mtp_detach_heads``).
- rng: detached heads draw their random numbers from streams of their own.
- supervision: per-depth targets and masks, labels derived from input ids.
- forward_settings: what one MTP forward computes, and the running step bound to its model.
- loss_branch: the per-depth loss branch of GPTModel's and HybridModel's postprocess.
- sparse_loss: that branch at the needed rows only, in chunks (``mtp_sparse_loss``).
- last_depth: the last depth's MLP at the rows its loss reads (with ``mtp_sparse_loss``).
- sparse_cross_entropy: the chunked vocabulary-parallel cross-entropy, the main head's at valid
  positions only (``sparse_lm_loss``).
- chunk_buffers: the buffers the chunks of one chunked projection share.
- draft_objectives: the depths' draft objectives (cross-entropy, TV, KL) and the acceptances.
- statistics: exact per-depth sums and counts (loss, acceptance, chain acceptance), the plain
  forwards' record.
- router_losses, router_metrics: MoE router losses per depth, normalized by the step.
- step: the exact step, one mechanism (``step.running``) with its adapters for a framework's own step
  and a controller's step in chunks; the public names a caller imports.
"""
