# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Build a GPT or a HybridModel (with optional MTP) on the current parallel layout, wrapped in
megatron-core DDP."""

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.runtime.specs import (
    SpecError,
    get_hybrid_stack_spec,
    gpt_specs,
    refuse_dropped,
    refuse_gated_delta_net_head_split,
)


def gpt_options(args) -> dict:
    """GPTModel's options from Megatron-LM arguments, as Megatron-LM's gpt_builders.py passes them
    (defaults for arguments an older checkpoint did not save)."""
    return dict(
        share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=getattr(args, "position_embedding_type", "learned_absolute"),
        rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=int(getattr(args, "rotary_base", 10000)),
        rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)),
    )


def _stage(vp_stage, pre_process, post_process):
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return first if pre_process is None else pre_process, last if post_process is None else post_process


def _set_impl(config: TransformerConfig, use_transformer_engine: bool) -> None:
    # The specs are selected by config.transformer_impl, as in Megatron-LM; the library's
    # callers say it by use_transformer_engine (TransformerConfig's default is Transformer Engine).
    if use_transformer_engine != (config.transformer_impl == "transformer_engine"):
        config.transformer_impl = "transformer_engine" if use_transformer_engine else "local"


def build_gpt(config: TransformerConfig, vocab_size: int, max_sequence_length: int,
              use_transformer_engine: bool = False, vp_stage: int | None = None,
              pre_process: bool | None = None, post_process: bool | None = None, pg_collection=None,
              layer_spec=None, core_attention=None, **options) -> GPTModel:
    """The GPTModel (with its MTP block on the last stage) of one (virtual) pipeline stage: the
    one GPT builder of the trainer, the library and serving. Its decoder and MTP specs are
    Megatron-LM's selection for the config (`layer_spec` replaces it, as --spec), with this
    device's modules (megatron.core.fork.runtime.specs.gpt_specs; `core_attention` replaces the local
    layers' SDPA attention: serving's cached one); `options` are GPTModel's (rotary by
    default, as in DeepSeek-V3: learned absolute positions with MTP under pipeline parallelism
    are refused, as the MTP stage's copy would not stay in sync)."""
    _set_impl(config, use_transformer_engine)
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        refuse_gated_delta_net_head_split(config)
    decoder_spec, mtp_spec = gpt_specs(config, vp_stage, layer_spec,
                                       **({"core_attention": core_attention} if core_attention else {}))
    pre_process, post_process = _stage(vp_stage, pre_process, post_process)
    options = {"position_embedding_type": "rope", "parallel_output": True, **options}
    return GPTModel(config=config, transformer_layer_spec=decoder_spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, pre_process=pre_process, post_process=post_process,
                    mtp_block_spec=mtp_spec, vp_stage=vp_stage, pg_collection=pg_collection, **options)


def build_hybrid(config: TransformerConfig, vocab_size: int, max_sequence_length: int, hybrid_layer_pattern: str,
                 use_transformer_engine: bool = False, vp_stage: int | None = None,
                 pre_process: bool | None = None, post_process: bool | None = None, pg_collection=None,
                 core_attention=None, **options):
    """The HybridModel of one (virtual) pipeline stage: `hybrid_layer_pattern` is upstream's
    "<main>/<mtp>/..." ("|" between pipeline stages); upstream's Transformer Engine stack spec,
    or the same layers of megatron-core's local modules (any device; `core_attention` replaces
    their SDPA core attention)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    _set_impl(config, use_transformer_engine)
    if use_transformer_engine:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    else:
        local = {"core_attention": core_attention} if core_attention else {}
        hybrid_stack_spec = get_hybrid_stack_spec(config, **local)
    refuse_dropped(config, hybrid_stack_spec.submodules.attention_layer, multi_latent=False)
    if "G" in hybrid_layer_pattern:
        refuse_gated_delta_net_head_split(config)
    pre_process, post_process = _stage(vp_stage, pre_process, post_process)
    options = {"position_embedding_type": "rope", "parallel_output": True, **options}
    if options.pop("rope_scaling", False):  # a GPTModel option HybridModel does not take
        raise SpecError("--use-rope-scaling: HybridModel has no rotary scaling; drop it")
    options.pop("rope_scaling_factor", None)
    return HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=vocab_size,
                       max_sequence_length=max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
                       pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                       pg_collection=pg_collection, **options)


def build_model(config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                use_distributed_optimizer: bool = False, use_transformer_engine: bool = False,
                share_embeddings_and_output_weights: bool = False, position_embedding_type: str = "rope",
                hybrid_layer_pattern: str | None = None, core_attention=None):
    """megatron-core's GPTModel (or HybridModel) with its MTP depths, one DDP-wrapped chunk per
    virtual pipeline stage of this rank, and the config's schedule hooks set.

    Args:
        config (TransformerConfig): the model and parallelism configuration, the fork's MTP fields
            included (megatron.core.fork.mtp.options); model parallelism must be initialized.
        vocab_size (int): the padded vocabulary size.
        max_sequence_length (int): the longest sequence the position embeddings cover.
        use_distributed_optimizer (bool): shard the DDP buffers for megatron-core's distributed
            optimizer.
        use_transformer_engine (bool): Transformer Engine's layer specs (GPUs) instead of the
            local ones.
        share_embeddings_and_output_weights (bool): tie the output layer to the input embedding.
        position_embedding_type (str): GPTModel's position_embedding_type ("rope", "yarn", ...).
        hybrid_layer_pattern (str, optional): build a HybridModel with this pattern (Mamba,
            Gated DeltaNet, attention and MLP layers; MTP after the "/").
        core_attention (type, optional): replaces the local modules' SDPA core attention
            (serving's cached one, for a model that trains and decodes: examples/rl).

    Returns:
        list[DistributedDataParallel]: the model chunks, in virtual-stage order.
    """
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        if hybrid_layer_pattern is None:
            model = build_gpt(config, vocab_size, max_sequence_length, use_transformer_engine, vp_stage=stage,
                              share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                              position_embedding_type=position_embedding_type, core_attention=core_attention)
        else:
            model = build_hybrid(config, vocab_size, max_sequence_length, hybrid_layer_pattern,
                                 use_transformer_engine, vp_stage=stage,
                                 share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                 position_embedding_type=position_embedding_type, core_attention=core_attention)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
        )
        chunks.append(DistributedDataParallel(config, ddp_config, model))
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    return chunks
