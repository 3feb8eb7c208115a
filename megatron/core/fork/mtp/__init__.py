# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Part "mtp": exact MTP training in megatron-core, what the patched GPTModel, HybridModel and
MTP block call into, and the step that normalizes every loss branch exactly.

- options: validation of the MTP flags on TransformerConfig.
- isolation: gradient isolation of the MTP heads (``mtp_detach_heads``).
- supervision: per-depth targets and masks, labels derived from input ids.
- statistics: exact per-depth sums and counts (loss, acceptance, chain acceptance).
- heads: the per-depth loss branch of GPTModel's postprocess.
- sparse_loss: that branch at the needed rows only, in chunks (``mtp_sparse_loss``).
- last_depth: the last depth's MLP at the rows its loss reads (with ``mtp_sparse_loss``).
- sparse_cross_entropy: the main head's loss at valid positions only, in chunks.
- draft_objectives: the depths' draft objectives (cross-entropy, TV, KL).
- rng: detached heads draw their random numbers from streams of their own.
- router_losses, router_metrics: MoE router losses per depth, normalized by the step.
- step_loss: one step's loss, every branch divided by its global count (the active step).
- step_scope: what a step reduces and reports across its micro-batches.
- exact_mtp_step, split_step: the step as a framework drives it (``ExactMTPStep``, ``SplitStep``).
"""
