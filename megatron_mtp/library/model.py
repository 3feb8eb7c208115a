"""Build a GPT or a HybridModel (with optional MTP) on the current parallel layout, wrapped in
megatron-core DDP."""

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.fork.specs import get_gpt_specs, get_hybrid_stack_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig


def build_gpt(config: TransformerConfig, vocab_size: int, max_sequence_length: int,
              use_transformer_engine: bool = False, vp_stage: int | None = None,
              share_embeddings_and_output_weights: bool = False,
              position_embedding_type: str = "rope") -> GPTModel:
    """The GPTModel (with its MTP block on the last stage) of one (virtual) pipeline stage."""
    layer_spec, mtp_spec = get_gpt_specs(config, use_transformer_engine, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        # Rotary by default, as in DeepSeek-V3. (Learned absolute positions with MTP under
        # pipeline parallelism are refused: the MTP stage's copy would not stay in sync.)
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )


def build_hybrid(config: TransformerConfig, vocab_size: int, max_sequence_length: int, hybrid_layer_pattern: str,
                 vp_stage: int | None = None, share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: str = "rope"):
    """The HybridModel of one (virtual) pipeline stage: `hybrid_layer_pattern` is upstream's
    "<main>/<mtp>/..." ("|" between pipeline stages), built from local modules (any device)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return HybridModel(
        config=config, hybrid_stack_spec=get_hybrid_stack_spec(config), vocab_size=vocab_size,
        max_sequence_length=max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )


def build_model(config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                use_distributed_optimizer: bool = False, use_transformer_engine: bool = False,
                share_embeddings_and_output_weights: bool = False, position_embedding_type: str = "rope",
                hybrid_layer_pattern: str | None = None):
    """One DDP-wrapped model per virtual pipeline stage (a GPTModel, or with
    `hybrid_layer_pattern` a HybridModel); sets the config's schedule hooks."""
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        if hybrid_layer_pattern is None:
            model = build_gpt(config, vocab_size, max_sequence_length, use_transformer_engine, vp_stage=stage,
                              share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                              position_embedding_type=position_embedding_type)
        else:
            model = build_hybrid(config, vocab_size, max_sequence_length, hybrid_layer_pattern, vp_stage=stage,
                                 share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                 position_embedding_type=position_embedding_type)
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
