# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The trainer's model for each architecture flag against upstream's builder (one process).

For each case, pretrain_gpt_mtp.py's arguments are parsed as the trainer parses them and its
model_provider builds the model; upstream's builder (megatron.training.models.gpt's
GPTModelBuilder: default_layer_spec and mtp_block_spec, the choices of Megatron-LM's
gpt_builders.py) builds the model of the same TransformerConfig. Recorded: both models'
parameter names and shapes, the attention classes the trainer's model holds (decoder and MTP
layers), its q/k norm classes, its norms' checkpoint keys, and its loss on a fixed batch (finite:
the layers run here).
"""

import contextlib
import io
import sys

import torch


def _parse(argv: list[str]):
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars

    from megatron_mtp import arguments

    destroy_num_microbatches_calculator()  # each parse sets Megatron-LM's globals anew
    global_vars.unset_global_variables()
    sys.argv = ["pretrain_gpt_mtp.py", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        args = arguments.parse()
    if args is None:
        return None, err.getvalue().strip().splitlines()[-1]
    global_vars.set_args(args)
    return args, None


def _upstream_model(args, config):
    """Upstream's builder on the same config. Its local specs keep DotProductAttention, which has no
    parameters and does not take multi-latent attention's head dimensions (k_channels, v_channels):
    for the build, those two are dropped; names and shapes are untouched by it."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import dot_product_attention
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    model_config = GPTModelConfig(
        transformer=config, vocab_size=args.padded_vocab_size, seq_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        **{name: getattr(config, name) for name in ("rotary_percent", "rotary_base") if hasattr(config, name)})
    if not hasattr(config, "rotary_percent"):
        model_config.rotary_percent, model_config.rotary_base = args.rotary_percent, args.rotary_base
    original = dot_product_attention.DotProductAttention.__init__

    def without_head_dims(self, *a, k_channels=None, v_channels=None, **kw):
        original(self, *a, **kw)

    dot_product_attention.DotProductAttention.__init__ = without_head_dims
    try:
        return GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                                         pre_process=True, post_process=True)
    finally:
        dot_product_attention.DotProductAttention.__init__ = original


def _shapes(model) -> dict:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _loss(model, vocab: int) -> float:
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    mask = torch.ones(2, 32)
    mask[0, 5:9] = 0
    losses = model(tokens, positions, None, labels=tokens.roll(-1, 1), loss_mask=mask)
    return float(losses.float().mean())


def builder_cases(cases: dict, save: str) -> dict:
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.training.arguments import core_transformer_config_from_args

    import pretrain_gpt_mtp
    from megatron.core.fork.runtime.specs import SpecError
    from megatron_mtp.serving.model import setup

    results = {}
    setup()
    for name, argv in cases.items():
        parsed, refused = _parse([*argv, "--save", save])
        if parsed is None:
            results[name] = {"refused": refused}
            continue
        config = core_transformer_config_from_args(parsed)
        try:
            ours = pretrain_gpt_mtp.model_provider(True, True, config=config)
        except SpecError as error:
            results[name] = {"refused": str(error)}
            continue
        upstream_config = core_transformer_config_from_args(parsed)
        if config.experimental_attention_variant is not None:
            # 0.19.2's mtp_block_spec asserts on the variant; the test checks the MTP layer against
            # the decoder's last one, as Megatron-LM's gpt_builders.py makes it
            upstream_config.mtp_num_layers = None
        upstream = _upstream_model(parsed, upstream_config)
        attentions = [m for m in ours.modules() if isinstance(m, (SelfAttention, MLASelfAttention))]
        results[name] = {
            "ours": _shapes(ours), "upstream": _shapes(upstream),
            "parameters": sum(parameter.numel() for parameter in ours.parameters()),  # each shared one once
            "attention": sorted({type(m).__name__ for m in attentions}),
            "attention_layers": len(attentions),
            "mixers": [type(layer.self_attention).__name__ for layer in ours.decoder.layers],
            "mtp_mixers": [type(layer.mtp_model_layer.self_attention).__name__ for layer in ours.mtp.layers],
            "norm_keys": sorted(sharded.key for sharded in ours.sharded_state_dict().values()  # checkpoint keys
                                if "norm" in sharded.key and not sharded.key.endswith("_extra_state")),
            "core_attention": sorted({type(m.core_attention).__name__ for m in attentions}),
            "qk_norms": sorted({type(getattr(m, n)).__name__ for m in attentions
                                for n in ("q_layernorm", "k_layernorm", "kv_layernorm") if hasattr(m, n)}),
            "gate": sorted({bool(getattr(m.config, "attention_output_gate", False)) for m in attentions}),
            "norms": sorted({type(m).__name__ for m in ours.modules()
                             if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))}),
            "norm_weights_zero": all(not m.weight.any() for m in ours.modules()
                                     if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))),
            "loss": _loss(ours, parsed.padded_vocab_size),
        }
    return results


def _reference_architectures() -> dict:
    """name -> (the reference's Architecture, the TransformerConfig fields that build it)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from tests.reference.gpt_mtp import Architecture, Latent

    latent = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=8,
                  v_head_dim=8, num_query_groups=4, config_class=MLATransformerConfig)  # (MLA has no groups)
    sizes = (16, 8, 8, 8, 8)
    # YaRN: context 4x the original 4096; pairs 0-1 kept, 2 blended, 3 interpolated (see the reference)
    yarn = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=4096, beta_fast=32,
                beta_slow=1, mscale=1.0, mscale_all_dim=0.5)
    return {
        "qk_layernorm": (Architecture(qk_norm=True), dict(qk_layernorm=True)),
        "qk_rmsnorm": (Architecture("RMSNorm", qk_norm=True), dict(qk_layernorm=True, normalization="RMSNorm")),
        "mla_rope": (Architecture("RMSNorm", latent=Latent(*sizes)),
                     dict(latent, rope_type="rope", normalization="RMSNorm")),
        # Qwen3-Next's full-attention layer: q/k RMSNorm, an output gate, RoPE on half of each head
        "gated_partial_rotary": (
            Architecture("RMSNorm", qk_norm=True, output_gate=True, rotary_percent=0.5),
            dict(qk_layernorm=True, normalization="RMSNorm", attention_output_gate=True,
                 model_options=dict(rotary_percent=0.5))),
        # zero-centred gamma (--apply-layernorm-1p): every norm (1 + w), q/k norms too, as Qwen3-Next's
        "zero_centred_qk_rmsnorm": (Architecture("RMSNorm1p", qk_norm=True),
                                    dict(qk_layernorm=True, normalization="RMSNorm",
                                         layernorm_zero_centered_gamma=True)),
        "zero_centred_layernorm": (Architecture("LayerNorm1p"), dict(layernorm_zero_centered_gamma=True)),
        "mla_yarn_qk_rmsnorm": (
            Architecture("RMSNorm", qk_norm=True, latent=Latent(*sizes, yarn=(4.0, 4096, 32, 1, 1.0, 0.5))),
            dict(latent, **yarn, qk_layernorm=True, normalization="RMSNorm")),
    }


# (depths, repeated, tied, isolated, recompute, rows, sparse MTP loss): both depths, isolation on
# and off, the repeated layer, padded rows with holes and packed rows of uneven segments.
REFERENCE_SETUPS = [(1, False, False, False, False, "padded", False), (2, False, False, True, False, "packed", False),
                    (2, True, True, False, False, "padded", True), (2, False, False, False, True, "packed", True),
                    (2, False, True, True, False, "padded", False)]


def against_the_reference() -> dict:
    """Each architecture in every REFERENCE_SETUPS case against tests/reference/gpt_mtp.py: logits,
    losses, every parameter's gradient and the per-depth statistics (compare_case of mtp_model)."""
    from tests.bodies.mtp_model import compare_case
    from tests.harness.layout import model_parallel

    results = {}
    with model_parallel():
        for name, (arch, fields) in _reference_architectures().items():
            for depths, repeated, tied, detach, recompute, layout, sparse in REFERENCE_SETUPS:
                case = f"{name}-D{depths}-{'rep' if repeated else 'dist'}-{'tied' if tied else 'untied'}-" \
                       f"{'iso' if detach else 'att'}-{'recomp' if recompute else 'norecomp'}-{layout}-" \
                       f"{'sparse' if sparse else 'dense'}"
                results[case] = compare_case(depths, repeated, tied, detach, recompute, layout, sparse, arch,
                                             transformer_impl="local", **fields)
    return results
