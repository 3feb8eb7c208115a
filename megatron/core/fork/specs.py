"""Layer specs that run on any device.

``get_gpt_layer_sdpa_spec`` is upstream's local (Transformer-Engine-free) GPT layer
spec with its ``core_attention`` replaced by ``SDPACoreAttention``; everything else
(parallel linears, norms, MLP, parameter names) is upstream's. ``get_gpt_specs`` gives
a model's decoder and MTP block specs the way Megatron-LM's GPT builder chooses them:
with experts, upstream's decoder block spec (MoE and dense layers by ``moe_layer_freq``),
and MTP depths whose layer is the backbone's last layer (an MoE layer when that one is,
as DeepSeek-V3's MTP layer).
"""

from megatron.core.fork.sdpa_attention import SDPACoreAttention
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec


def _with_sdpa(spec: ModuleSpec) -> ModuleSpec:
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def get_gpt_layer_sdpa_spec(**local_spec_kwargs) -> ModuleSpec:
    return _with_sdpa(get_gpt_layer_local_spec(**local_spec_kwargs))


def get_gpt_specs(config, use_transformer_engine: bool, vp_stage=None):
    """(decoder spec, MTP block spec or None) of one (virtual) pipeline stage."""
    if config.num_moe_experts is None:
        if use_transformer_engine:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            layer = decoder = get_gpt_layer_with_transformer_engine_spec()
        else:
            layer = decoder = get_gpt_layer_sdpa_spec()
    else:
        options = dict(normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
        decoder = get_gpt_decoder_block_spec(config, use_transformer_engine, vp_stage=vp_stage, **options)
        layer = get_gpt_decoder_layer_specs(config, use_transformer_engine, **options)[-1]
        if not use_transformer_engine:
            for spec in {id(s): s for s in [*decoder.layer_specs, layer]}.values():
                _with_sdpa(spec)
    mtp = (get_gpt_mtp_block_spec(config, layer, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage)
           if config.mtp_num_layers else None)
    return decoder, mtp
