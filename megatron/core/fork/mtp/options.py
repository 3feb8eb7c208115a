# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The fork's TransformerConfig fields and their validation, in one place.

TransformerConfig derives from MTPTrainingConfig (one changed line in upstream's file) instead
of from ModelParallelConfig, so the fork's fields are TransformerConfig fields, and thus
Megatron-LM flags (--no-mtp-sparse-loss, --exact-steps, ...) with their docstrings as help,
without hunks among upstream's own fields, and the MTP options are validated when the
config is built, before any module or state exists.
"""

from dataclasses import dataclass

from megatron.core.model_parallel_config import ModelParallelConfig

from megatron.core.fork.mtp import draft_objectives
from megatron.core.fork.runtime import compat


@dataclass
class MTPTrainingConfig(ModelParallelConfig):
    """ModelParallelConfig plus the fields the fork adds to TransformerConfig."""

    mtp_sparse_loss: bool = True
    """Compute each MTP depth's logits and cross-entropy only at the positions that count at
    that depth, in chunks of sparse_loss_chunk_size rows, with the gradients taken from the
    same logits in the forward: work scales with the valid positions and at most one chunk of
    logits exists at a time. Equal to the dense computation to float round-off. False
    (--no-mtp-sparse-loss): project every position, as upstream does."""

    sparse_loss_chunk_size: int = 1024
    """Rows per chunk of the sparse losses (mtp_sparse_loss: valid positions of all MTP depths
    together; sparse_lm_loss): one chunk's logits, chunk x vocabulary / tensor-parallel size in
    fp32, is their peak memory."""

    sparse_lm_loss: bool = False
    """Compute the main head's logits and cross-entropy only where loss_mask is nonzero, in
    chunks of sparse_loss_chunk_size rows, like mtp_sparse_loss. The per-token loss is zero
    elsewhere and must be summed times that loss_mask (as pretrain_gpt's loss function does;
    another weighting raises in the backward). Off: upstream's dense loss."""

    mtp_loss_type: str = "ce"
    """What each MTP depth k is trained toward (spec section 12; see
    megatron.core.fork.mtp.draft_objectives): 'ce', cross-entropy against the data token (upstream's; its name
    'cross_entropy' is accepted too); 'kl', KL(p || q) from the main head's distribution p at
    t + k to the draft's q; 'tv', 1 - sum_v min(p, q), what a rejection sampler rejects;
    'e2e_tv', one minus the normalized expected accepted length of the chained draft. All are
    normalized by the step's main-token count. 'kl', 'tv' and 'e2e_tv' need
    --mtp-detach-heads."""

    mtp_draft_temperature: float = 1.0
    """The sampling temperature tau of the draft objectives and of the sampled-acceptance
    metrics: p and q are softmaxes of the logits divided by tau (the rollouts' temperature)."""

    mtp_sampled_acceptance: bool = True
    """Record the sampled- and greedy-draft-acceptance metrics (spec section 12: mtp_k sampled
    acceptance, expected accepted length (sampling), and their greedy-draft forms) when training
    with 'ce' too, in the steps that report their metrics (the trainer's printed steps and
    evaluations; a library step asked with metrics=True). They need the main head at t + k for
    every MTP row and both distributions there, which the draft objectives compute anyway. False
    (--no-mtp-sampled-acceptance): 'ce' never measures them, and they are not reported."""

    exact_steps: bool = False
    """Make every step of megatron.training's loop exact (megatron.core.fork.training_loop.exact_step)
    for a loss function with upstream pretrain_gpt.py's per-token contract (the raw masked sum
    and its token count): one normalization by the step's global counts for the main loss
    (token level), every MTP depth and the MoE router losses, whatever the micro-batches and
    layout. Needs calculate_per_token_loss and the series' training-loop part (its hooks in
    megatron.training read this field). A trainer that enables exact steps itself
    (pretrain_gpt_mtp.py) does not need it."""

    def __post_init__(self):
        super().__post_init__()
        validate_mtp_options(self)


def _mtp_on_the_first_pipeline_rank(config) -> bool:
    """Upstream's layout check means to keep MTP off the first pipeline rank but skips that rank's
    last virtual stage, the only one MTP may take."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is None or config.pipeline_model_parallel_size < 2:
        return False
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    if isinstance(layout, str):
        layout = PipelineParallelLayerLayout.from_str(layout, config.pipeline_model_parallel_size)
    return any(LayerType.mtp in stage for stage in layout.layout[0])


def validate_mtp_options(config) -> None:
    """Raise ValueError naming the contradiction and the fix; called from TransformerConfig."""
    depths = config.mtp_num_layers or 0
    if depths < 0:
        raise ValueError(f"mtp_num_layers must be >= 0, got {depths}")
    if config.mtp_detach_heads and depths == 0:
        raise ValueError(
            "mtp_detach_heads (--mtp-detach-heads) isolates MTP heads, but mtp_num_layers is not set; "
            "set --mtp-num-layers D >= 1 or drop --mtp-detach-heads"
        )
    if config.mtp_use_repeated_layer and depths == 0:
        raise ValueError(
            "mtp_use_repeated_layer (--mtp-use-repeated-layer) applies one MTP layer at every depth, "
            "but mtp_num_layers is not set; set --mtp-num-layers D >= 1 or drop --mtp-use-repeated-layer"
        )
    if depths and config.context_parallel_size > 1 and not compat.mtp_rolls_across_context_parallel_ranks():
        raise ValueError(
            f"MTP (mtp_num_layers={depths}) with context parallelism (context_parallel_size="
            f"{config.context_parallel_size}) needs megatron-core 0.19.2's series (its exact roll of depth-k "
            "targets across context-parallel ranks); this megatron-core's is not exact. "
            "Use --context-parallel-size 1, or megatron-core 0.19.2."
        )
    if ((depths and config.mtp_sparse_loss) or config.sparse_lm_loss) and config.sparse_loss_chunk_size < 1:
        raise ValueError(
            f"sparse_loss_chunk_size (--sparse-loss-chunk-size) must be >= 1 rows, got {config.sparse_loss_chunk_size}"
        )
    if config.exact_steps and not config.calculate_per_token_loss:
        raise ValueError(
            "exact_steps (--exact-steps) normalizes the loss function's raw per-token sums once per step: "
            "add --calculate-per-token-loss (without it the schedules divide each micro-batch by its own count)"
        )
    if depths and _mtp_on_the_first_pipeline_rank(config):
        raise ValueError(
            f"the pipeline layout {config.pipeline_model_parallel_layout!r} puts the MTP depths on the first "
            "pipeline rank's last virtual stage: that rank would hold two word-embedding copies, of which "
            "megatron-core's finalize_model_grads reduces only one (wrong gradients; tied, the build hangs). "
            "Put them on another pipeline rank, e.g. with the loss (...|mmL)"
        )
    objective = draft_objectives.objective_of(config)
    if objective not in draft_objectives.OBJECTIVES:
        raise ValueError(
            f"mtp_loss_type (--mtp-loss-type) must be one of {', '.join(draft_objectives.OBJECTIVES)} "
            f"(or upstream's 'cross_entropy'), got {config.mtp_loss_type!r}"
        )
    if not config.mtp_draft_temperature > 0:
        raise ValueError(
            f"mtp_draft_temperature (--mtp-draft-temperature) must be > 0, got {config.mtp_draft_temperature}"
        )
    if depths and objective != "ce" and not compat.carries_draft_objectives():
        raise ValueError(
            f"mtp_loss_type={objective!r} needs megatron-core 0.19.2's series (the draft objectives are built and "
            "tested there); this megatron-core's trains 'ce' only. Use --mtp-loss-type ce, or megatron-core 0.19.2."
        )
    if depths and objective != "ce" and not config.mtp_detach_heads:
        raise ValueError(
            f"mtp_loss_type={objective!r} trains the heads toward the main head's own distribution, which must "
            "not move: add --mtp-detach-heads (mtp_detach_heads=True), or use --mtp-loss-type ce"
        )
    if depths and (config.mtp_loss_scaling_factor is None or config.mtp_loss_scaling_factor < 0):
        raise ValueError(
            f"mtp_loss_scaling_factor must be a number >= 0, got {config.mtp_loss_scaling_factor}"
        )


def validate_mtp_model(config, position_embedding_type: str) -> None:
    """Refuse model layouts whose copies of MTP's shared parameters would not stay in sync;
    called by GPTModel on every rank with the same arguments, before any module is built.

    The MTP block embeds tokens on its own (last) pipeline stage, so that stage holds a copy
    of the embedding. The word embedding's copies are initialized and reduced together;
    a learned absolute position embedding's are not (and cannot be checkpointed)."""
    if (config.mtp_num_layers or 0) and position_embedding_type == "learned_absolute" \
            and config.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"MTP (mtp_num_layers={config.mtp_num_layers}) with learned absolute position embeddings under "
            f"pipeline parallelism (pipeline_model_parallel_size={config.pipeline_model_parallel_size}) is not "
            "supported: the MTP stage's copy of the position embedding would not be kept in sync with the "
            "first stage's. Use rotary positions (position_embedding_type='rope', --position-embedding-type "
            "rope, as DeepSeek-V3) or pipeline_model_parallel_size=1."
        )
