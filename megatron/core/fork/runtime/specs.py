# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Layer specs as Megatron-LM chooses them, with the modules this device needs.

``gpt_specs`` takes a GPTModel's decoder and MTP block specs from upstream's own selection:
on 0.19.2 Megatron-LM's ``megatron.training.models.gpt`` (``default_layer_spec``,
``mtp_block_spec``: the choices of Megatron-LM's ``gpt_builders.py``: experimental
attention variants, MoE block specs with dense layers by ``moe_layer_freq``, heterogeneous
layers, ``qk_layernorm``, ``multi_latent_attention``, ``normalization``); on 0.16.1, whose
sdist has no ``megatron.training``, the same choices through megatron-core's spec functions.
``on_this_device`` is the one hook that changes them: with Transformer Engine nothing changes
(the GPU path is upstream's byte for byte); with megatron-core's local modules it swaps the
core attention for ``SDPACoreAttention`` (packed rows, any device). ``refuse_dropped`` refuses
in one line an architecture flag the specs do not build.

Where this fork builds layers from local modules that Transformer Engine fuses (Gated DeltaNet
on GPTModel, HybridModel's layers), ``name_norms_as_fused`` gives them TE's checkpoint names.

``get_hybrid_stack_spec`` is upstream's HybridModel stack spec (``hybrid_stack_spec``,
Transformer-Engine-only) built from the same local modules: an attention layer (``*``) is
the GPT layer's attention half, an MLP layer (``-``) its MLP half, so a pattern "*-" per
layer is the GPT network; the MTP depths' inner layers come from the same pattern characters.
"""

import dataclasses

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.core.fork.runtime import compat
from megatron.core.fork.runtime.sdpa_attention import SDPACoreAttention


class SpecError(ValueError):
    """An architecture flag the selected specs do not build (one line)."""


def _walk(node, visit, seen=None):
    """Call visit(holder, field name, value) for every field of every submodules dataclass
    reachable from `node` (ModuleSpecs, lists of them, submodules dataclasses), each once."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, ModuleSpec):
        _walk(node.submodules, visit, seen)
    elif isinstance(node, (list, tuple)):
        for child in node:
            _walk(child, visit, seen)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            visit(node, field.name, value)
            _walk(value, visit, seen)


def replace_modules(replacements: dict, *specs) -> None:
    """Every submodule class `old` in the specs (in place) made `replacements[old]`."""

    def visit(holder, name, value):
        if isinstance(value, type) and value in replacements:
            setattr(holder, name, replacements[value])

    for spec in specs:
        _walk(spec, visit)


def on_this_device(config, *specs, core_attention=SDPACoreAttention) -> None:
    """The one change to upstream's specs: with megatron-core's local modules, upstream's
    DotProductAttention (CUDA buffers, no packed rows, no MLA head dimensions) becomes
    SDPACoreAttention (or `core_attention`: serving's cached one), and under qk_l2_norm the q/k
    norms are L2Norm, as in upstream's
    Transformer Engine layer spec (its local dense selection leaves them out). Transformer
    Engine's specs are left as upstream builds them."""
    if config.transformer_impl == "transformer_engine":
        return
    replace_modules({DotProductAttention: core_attention}, *specs)
    if config.qk_l2_norm:
        from megatron.core.transformer.attention import SelfAttentionSubmodules
        from megatron.core.transformer.torch_norm import L2Norm

        for spec in _attention_submodules(*specs):
            if isinstance(spec.submodules, SelfAttentionSubmodules):
                spec.submodules.q_layernorm = spec.submodules.k_layernorm = L2Norm


def _attention_submodules(*specs) -> list:
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    found = []

    def visit(holder, name, value):
        if isinstance(value, ModuleSpec) and isinstance(value.submodules, (SelfAttentionSubmodules,
                                                                            MLASelfAttentionSubmodules)):
            found.append(value)

    for spec in specs:
        _walk(spec, visit)
    return found


def refuse_dropped(config, *specs, multi_latent: bool = True) -> None:
    """Raise SpecError when the specs do not build an architecture flag of `config`: q/k norms
    with qk_layernorm, L2 q/k norms with qk_l2_norm, and (`multi_latent`: a GPT's specs, where
    the flag selects the attention; a HybridModel's pattern places it) every attention layer
    multi-latent with multi_latent_attention."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm

    if config.layernorm_zero_centered_gamma and not compat.torch_norms_have_zero_centered_gamma():
        torch_norms = []
        _walk(list(specs), lambda holder, name, value: torch_norms.append(value) if value is WrappedTorchNorm else None)
        if torch_norms:
            raise SpecError("--apply-layernorm-1p (zero-centred gamma) is not built by this build's torch norms, "
                            "which these local specs use (the 0.19.2 build's, Apex's and Transformer Engine's have it)")
    attentions = _attention_submodules(*specs)
    for spec in attentions:
        sub = spec.submodules
        norms = [getattr(sub, n) for n in ("q_layernorm", "k_layernorm", "kv_layernorm") if hasattr(sub, n)]
        if config.qk_l2_norm and not all(norm is L2Norm for norm in norms if norm is not None):
            raise SpecError(f"--qk-l2-norm is not built by {spec.module.__name__}'s spec here (its q/k norms are "
                            f"{', '.join(getattr(n, '__name__', str(n)) for n in norms)}); drop it")
        if config.qk_layernorm and any(norm in (None, IdentityOp) for norm in norms):
            raise SpecError(f"--qk-layernorm is not built by {spec.module.__name__}'s spec here (it has no q/k "
                            "norms); drop it")
    if multi_latent and config.multi_latent_attention and any(spec.module is not MLASelfAttention
                                                              for spec in attentions):
        raise SpecError("--multi-latent-attention is not built by these specs (their attention is "
                        f"{sorted({s.module.__name__ for s in attentions})}); drop it")


def refuse_gated_delta_net_head_split(config) -> None:
    """Raise SpecError when context parallelism cannot split Gated DeltaNet layers: upstream's
    all-to-all gives each context-parallel rank whole key and value heads of its tensor-parallel
    rank's (it fails deep in the forward pass otherwise)."""
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    if cp == 1:
        return
    for flag, heads in (("--linear-num-key-heads", config.linear_num_key_heads),
                        ("--linear-num-value-heads", config.linear_num_value_heads)):
        if heads % (tp * cp):
            raise SpecError(f"{flag} {heads}: Gated DeltaNet layers with context parallelism give each of the {cp} "
                            f"context-parallel ranks whole heads of each tensor-parallel rank's (upstream's "
                            f"all-to-all): use a multiple of TP x CP = {tp * cp}")


def local_self_attention_spec(config) -> ModuleSpec:
    """The full-attention layers' attention of upstream's experimental-variant block (its
    Transformer Engine layer's) from megatron-core's local GPT layer: its input norm apart."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    attention = get_gpt_layer_local_submodules(qk_layernorm=config.qk_layernorm,
                                               multi_latent_attention=config.multi_latent_attention,
                                               normalization=config.normalization,
                                               qk_l2_norm=config.qk_l2_norm).self_attention
    attention.metainfo["fuse_input_layernorm"] = False
    return attention


def _fused_norm_names() -> dict:
    """Where Transformer Engine fuses a layer's norm into the next projection, the name its
    checkpoints give the norm: {(norm field, the class the next module builds): checkpoint
    prefix}. (MLA's and the MoE layers' input and pre-MLP norms are not fused.)"""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    return {("input_layernorm", SelfAttention): "self_attention.linear_qkv.layer_norm_",
            ("input_layernorm", GatedDeltaNet): "self_attention.in_proj.layer_norm_",
            ("pre_mlp_layernorm", MLP): "mlp.linear_fc1.layer_norm_"}


def name_norms_as_fused(*specs) -> None:
    """Give every TransformerLayer spec in `specs` (in place) Transformer Engine's checkpoint
    names for the norms it fuses (`_fused_norm_names`), which the local layers keep apart, so
    checkpoints move between the two (upstream's local GPT layer names its own so; names a spec
    already maps are kept)."""
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    fused = _fused_norm_names()
    layers = {}  # every TransformerLayerSubmodules reached (the walk's holders), each once
    _walk(list(specs), lambda holder, name, value: layers.setdefault(id(holder), holder)
          if isinstance(holder, TransformerLayerSubmodules) else None)
    for sub in layers.values():
        names = {}
        for norm, module in (("input_layernorm", "self_attention"), ("pre_mlp_layernorm", "mlp")):
            prefix = fused.get((norm, _built_class(getattr(sub, module))))
            if prefix is not None and getattr(sub, norm) is not IdentityOp:
                names[f"{norm}."] = prefix
        sub.sharded_state_dict_keys_map = {**names, **sub.sharded_state_dict_keys_map}


def _built_class(spec):
    """The class a submodule spec builds: a ModuleSpec's module, or a builder partial's class
    (`partial(MoELayer, ...)`) or the class whose method it binds (0.19.2's MLP builders,
    `MLP.as_mlp_submodule`)."""
    if isinstance(spec, ModuleSpec):
        return spec.module
    func = getattr(spec, "func", None)
    return func if isinstance(func, type) else getattr(func, "__self__", None)


def _upstream_gpt_specs(config, vp_stage, layer_spec):
    use_te = config.transformer_impl == "transformer_engine"
    variant = getattr(config, "experimental_attention_variant", None)
    if variant not in (None, "gated_delta_net") and not use_te:
        raise SpecError(f"--experimental-attention-variant {variant} is built with Transformer Engine only here "
                        "(this build carries the local layers of gated_delta_net)")
    try:
        from megatron.training.models.gpt import GPTModelConfig, default_layer_spec, mtp_block_spec
    except ImportError:  # 0.16.1: megatron-core's spec functions, as that release's gpt_builders.py calls them
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_decoder_layer_specs,
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
            get_gpt_mtp_block_spec,
        )

        options = dict(normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
        if variant is not None:  # (the selection below would build plain attention layers)
            raise SpecError(f"--experimental-attention-variant {variant} needs the 0.19.2 build (0.16.1's series "
                            "does not carry its layer selection)")
        if config.multi_latent_attention and not use_te:
            raise SpecError("--multi-latent-attention without Transformer Engine needs the 0.19.2 build (0.16.1's "
                            "runtime part leaves its YaRN rotary embedding on CUDA)")
        if layer_spec is not None:
            decoder = layer_spec
        elif config.num_moe_experts:
            decoder = get_gpt_decoder_block_spec(config, use_te, vp_stage=vp_stage, **options)
        elif use_te:
            decoder = get_gpt_layer_with_transformer_engine_spec(
                None, False, config.qk_layernorm, config.multi_latent_attention, qk_l2_norm=config.qk_l2_norm)
        else:
            decoder = get_gpt_layer_local_spec(None, False, config.qk_layernorm, config.multi_latent_attention,
                                               **options)
        mtp = None
        if config.mtp_num_layers:
            layer = get_gpt_decoder_layer_specs(config, use_te, **options)[-1]
            mtp = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=use_te, vp_stage=vp_stage)
        return decoder, mtp
    # GPTModelConfig proxies its fields to the TransformerConfig when it has them (MLA's
    # rotary_base, rotary_percent): give it the config's own values, or it overwrites them.
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(GPTModelConfig)
              if f.init and f.name != "transformer" and hasattr(config, f.name)}
    model_config = GPTModelConfig(transformer=config, transformer_layer_spec=layer_spec, **shared)
    # (the variant's MTP layer is checked before anything is built)
    mtp_layer = _experimental_variant_mtp_layer(config) if variant is not None and config.mtp_num_layers else None
    decoder = layer_spec if layer_spec is not None else default_layer_spec(model_config, vp_stage)
    if variant is None:
        return decoder, mtp_block_spec(model_config, decoder, vp_stage=vp_stage) if config.mtp_num_layers else None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    mtp = mtp_layer and get_gpt_mtp_block_spec(config, mtp_layer, use_transformer_engine=use_te, vp_stage=vp_stage)
    if not use_te:  # the local layers keep Transformer Engine's checkpoint names
        name_norms_as_fused(decoder, mtp)
    return decoder, mtp


def _experimental_variant_mtp_layer(config) -> ModuleSpec:
    """The MTP layer of an experimental-variant GPT as Megatron-LM's gpt_builders.py takes it
    (0.19.2's megatron.training.models.gpt asserts on the variant): the whole decoder's last
    layer spec. gpt_builders.py takes a plain GPT layer instead on a last stage that holds no
    decoder layer; this one does not, so the model is the same on every pipeline layout. MTP
    layers attend with a causal mask: a last layer of Gated DeltaNet is refused."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    last = get_transformer_layer_with_experimental_attention_variant_spec(config)[-1]
    if _built_class(last.submodules.self_attention) is GatedDeltaNet:
        raise SpecError(f"--mtp-num-layers with --experimental-attention-variant "
                        f"{config.experimental_attention_variant}: "
                        "the MTP layer is the decoder's last layer, a Gated DeltaNet layer here, and MTP layers attend "
                        "with a causal mask: make the last layer full attention (--num-layers a multiple of "
                        "--linear-attention-freq, or a pattern ending in 0)")
    return last


def gpt_specs(config, vp_stage=None, layer_spec=None, core_attention=SDPACoreAttention):
    """(decoder spec, MTP block spec or None) of one (virtual) pipeline stage, for
    config.transformer_impl: upstream's selection (or `layer_spec`, as Megatron-LM's --spec),
    its MTP layer the decoder's last layer spec (an MoE layer when that one is, as DeepSeek-V3's
    MTP layer), then this device's modules. A flag the specs do not build raises SpecError."""
    decoder, mtp = _upstream_gpt_specs(config, vp_stage, layer_spec)
    on_this_device(config, decoder, mtp, core_attention=core_attention)
    refuse_dropped(config, decoder, mtp)
    return decoder, mtp


def norm_without_te(te_norm):
    """`te_norm` (Transformer Engine's norm, which HybridStack uses for its final norm) where
    Transformer Engine is installed, else the local backend's norm (torch's, or Apex's)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.backends import LocalSpecProvider

    return te_norm if HAVE_TE else LocalSpecProvider().layer_norm()


def get_hybrid_stack_spec(config, core_attention=SDPACoreAttention) -> ModuleSpec:
    """A HybridStack spec of local modules (any device): attention ``*``, MLP ``-``, MoE ``E``
    (with experts), Gated DeltaNet ``G`` and the MTP block, attention's core `core_attention`
    (serving's cached one, for a model that decodes); the other layer types need Transformer
    Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules, get_gpt_mtp_block_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gpt = get_gpt_layer_local_submodules(normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda)
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda)
    mtp = get_gpt_mtp_block_spec(config, ModuleSpec(module=TransformerLayer, submodules=gpt),
                                 use_transformer_engine=False)
    for layer in mtp.layer_specs if mtp is not None else ():  # (None off the MTP stage) layers from the pattern
        layer.submodules = dataclasses.replace(layer.submodules, mtp_model_layer=None)
    on_this_device(config, gpt, mtp, core_attention=core_attention)
    layers = dict(attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
                  mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp), mtp_block_spec=mtp)
    if config.linear_num_value_heads:  # (0.19.2's fields) Gated DeltaNet layers, "G"
        layers["gdn_layer"] = _gated_delta_net_layer(gpt)
    if config.num_moe_experts:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.transformer_layer import MoETransformerLayer

        experts = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=experts, mlp_bda=gpt.mlp_bda))
    name_norms_as_fused(*layers.values())
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**layers))


def _gated_delta_net_layer(gpt) -> ModuleSpec:
    """Upstream's HybridModel GDN layer (hybrid_layer_specs.py: TELayerNormColumnParallelLinear,
    TENorm, TERowParallelLinear) from local modules: the input norm apart from the projection,
    under the name Transformer Engine's fused one has in checkpoints (`name_norms_as_fused`).
    Without FLA and CUDA the runtime part gives GatedDeltaNet its kernels in PyTorch."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=gpt.input_layernorm, out_proj=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=mixer, self_attn_bda=gpt.self_attn_bda))
