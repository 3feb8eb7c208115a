"""Layer specs that run on any device.

``get_gpt_layer_sdpa_spec`` is upstream's local (Transformer-Engine-free) GPT layer
spec with its ``core_attention`` replaced by ``SDPACoreAttention``; everything else
(parallel linears, norms, MLP, parameter names) is upstream's. ``get_gpt_specs`` gives
a model's decoder and MTP block specs the way Megatron-LM's GPT builder chooses them:
with experts, upstream's decoder block spec (MoE and dense layers by ``moe_layer_freq``),
and MTP depths whose layer is the backbone's last layer (an MoE layer when that one is,
as DeepSeek-V3's MTP layer). ``get_hybrid_stack_spec`` is upstream's HybridModel stack spec
(``hybrid_stack_spec``, Transformer-Engine-only) built from the same local modules: an
attention layer (``*``) is the GPT layer's attention half, an MLP layer (``-``) its MLP
half, so a pattern "*-" per layer is the GPT network; the MTP depths' inner layers come
from the same pattern characters.
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


def norm_without_te(te_norm):
    """`te_norm` (Transformer Engine's norm, which HybridStack uses for its final norm) where
    Transformer Engine is installed, else the local backend's norm (torch's, or Apex's)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.backends import LocalSpecProvider

    return te_norm if HAVE_TE else LocalSpecProvider().layer_norm()


def get_hybrid_stack_spec(config) -> ModuleSpec:
    """A HybridStack spec of local modules (any device): attention ``*``, MLP ``-``, MoE ``E``
    (with experts) and the MTP block; the other layer types need Transformer Engine."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gpt = get_gpt_layer_local_submodules(normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    gpt.self_attention.submodules.core_attention = SDPACoreAttention
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})
    mtp = get_gpt_mtp_block_spec(config, ModuleSpec(module=TransformerLayer, submodules=gpt),
                                 use_transformer_engine=False)
    for layer in mtp.layer_specs if mtp is not None else ():  # (None off the MTP stage) layers from the pattern
        layer.submodules = dataclasses.replace(layer.submodules, mtp_model_layer=None)
    layers = dict(attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
                  mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp), mtp_block_spec=mtp)
    if config.num_moe_experts:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.transformer_layer import MoETransformerLayer

        experts = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=experts, mlp_bda=gpt.mlp_bda))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**layers))


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
