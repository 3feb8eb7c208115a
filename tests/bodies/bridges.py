# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Test bodies of tests/test_bridges.py: Hugging Face's MoE, multi-latent attention and Gated
DeltaNet families through tools/convert_checkpoint.py (one process, megatron-core imported once).

References: the `transformers` classes installed here (Qwen3MoeForCausalLM, DeepseekV3ForCausalLM,
Glm4MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) on tiny
random configs made here, with non-unit norms,
a non-zero expert bias and Gated DeltaNet's dt_bias away from one; for the MTP depths, a forward
written from the engines' MTP semantics (the next token's embedding through enorm, the previous
depth's hidden state through hnorm, a projection over their concatenation [embedding, hidden], one
decoder layer, a final norm, the output layer) on the checkpoint's tensors in its layout: DeepSeek-V3's
(GLM-4.5's: enorm, hnorm, eh_proj, shared_head.norm, shared_head.head per depth) or Qwen3-Next's
(Qwen3.5's too: mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, mtp.norm for all
depths, (1 + w) norms, the main model's embedding and head), whose decoder layer is transformers'
own (a one-layer DeepseekV3Model / Glm4MoeModel / Qwen3NextModel / Qwen3_5TextModel /
Qwen3_5MoeTextModel whose final norm is the depth's).
"""

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

VOCAB = 257
TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
DEEPSEEK_MTP = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "shared_head.head.weight", "embed_tokens.weight"]
MLA = ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
       "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
       "self_attn.o_proj.weight"]
GQA = ["self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
       "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
       "self_attn.o_proj.weight"]


def _run(main, argv, printed: io.StringIO | None = None) -> tuple[int, str]:
    """A tool's main() in this process: its exit status (argparse's too) and error output; its
    output into `printed` if given."""
    err = io.StringIO()
    with redirect_stdout(printed or io.StringIO()), redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exit_:
            status = exit_.code
    return status, err.getvalue()


def _convert(*argv: str, printed: io.StringIO | None = None) -> tuple[int, str]:
    from tools import convert_checkpoint

    return _run(convert_checkpoint.main, argv, printed)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _randomize(model) -> None:
    """Norms away from their initialization (1, or 0 for (1 + w) norms), an expert bias away from 0
    and Gated DeltaNet's dt_bias away from 1, so a swapped, dropped or unshifted one shows; Gated
    DeltaNet's output norm ((w) in transformers, (1 + w) in megatron-core) also below 0.5, where
    the shift by one rounds in fp32."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                tensor.normal_(1, 0.2)
                if name.endswith("linear_attn.norm.weight"):
                    tensor[:3] = torch.tensor([0.1, -0.3, 1e-3])
            elif name.endswith(("e_score_correction_bias", "dt_bias")):
                tensor.normal_(0, 0.1)


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def _runner(path):
    from megatron_mtp.serving import files
    from megatron_mtp.serving import model as serving_model

    args, directory = files.read_arguments(str(path))
    serving_model.setup()
    model = serving_model.build(args)
    serving_model.load(model, str(directory))
    return serving_model.Runner(model, args.vocab_size)


def _compared(original: dict, back: dict) -> dict:
    """An export's tensors against the original's: names on one side only, tensors that differ,
    and of those the ones that are exactly (w - 1) + 1 in fp32 (a shifted norm exports the scale
    the model computes with: fp32 cannot hold w - 1 for w < 0.5) and the ones differing at w >= 0.5."""
    differing = sorted(n for n in set(original) & set(back) if not torch.equal(original[n], back[n]))
    return {"names only one side": sorted(set(original) ^ set(back)), "differing": differing,
            "differing as the model computes them": [n for n in differing
                                                     if torch.equal(back[n], (original[n] - 1) + 1)],
            "differing at w >= 0.5": [n for n in differing
                                      if bool(((original[n] != back[n]) & (original[n] >= 0.5)).any())]}


def _import_export(root: Path, name: str, model, *export_flags: str) -> dict:
    """Import, logits against transformers'; export, tensors and config back, logits again."""
    from transformers import AutoModelForCausalLM

    out = {"import": _convert("import", str(root / name), str(root / f"{name}-mg"))}
    with torch.no_grad():
        expected = model.eval()(TOKENS).logits
    main, per_depth = _runner(root / f"{name}-mg").teacher_forced(TOKENS)
    out["logits"] = _rel(main, expected)
    out["export"] = _convert("export", str(root / f"{name}-mg"), str(root / f"{name}-back"), *export_flags)
    back = _tensors(root / f"{name}-back")
    out.update(_compared(_tensors(root / name), back), tensors=len(back))
    reloaded = AutoModelForCausalLM.from_pretrained(str(root / f"{name}-back"), dtype=torch.float32).eval()
    with torch.no_grad():
        out["export's logits"] = _rel(reloaded(TOKENS).logits, expected)
    out["config"] = json.loads((root / f"{name}-back" / "config.json").read_text())
    out["flags"] = (root / f"{name}-mg" / "megatron_flags.txt").read_text().split()
    return out, per_depth


# ---------------------------------------------------------------- Qwen3-MoE

def qwen3_moe(root: Path) -> dict:
    """Qwen3-MoE: q/k norms, a dense first layer (mlp_only_layers), 4 experts top-2, with
    normalized top-k probabilities (softmax over the chosen logits) and without (softmax,
    then top-k: --moe-router-pre-softmax), experts on every second layer (decoder_sparse_step)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    results = {}
    for name, extra in (("qwen3-moe", dict(mlp_only_layers=[0], norm_topk_prob=True)),
                        ("qwen3-moe-pre-softmax", dict(decoder_sparse_step=2, norm_topk_prob=False))):
        torch.manual_seed(5)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=128, rope_theta=1e6, rms_norm_eps=1e-6, **extra))
        _randomize(model)
        model.save_pretrained(root / name)
        results[name], _ = _import_export(root, name, model)
    return results


# ---------------------------------------------------------------- DeepSeek-V3

L, D = 3, 2
DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=16384, rms_norm_eps=1e-6,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


GLM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
           num_key_value_heads=2, head_dim=24, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
           n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
           n_shared_experts=2, routed_scaling_factor=1.5, max_position_embeddings=128, rms_norm_eps=1e-5,
           rope_theta=1e6)


# Qwen3-Next: Gated DeltaNet layers (2 key heads of 4 value heads: a key head's value heads interleave
# in its checkpoints) beside a gated full-attention layer, 4 experts top-2 with a gated shared expert.
QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, partial_rotary_factor=0.5,
                  max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6)
QWEN3_NEXT_LAYERS = ["linear_attention", "linear_attention", "full_attention"]  # full_attention_interval 3
# Qwen3.5: Qwen3-Next's shapes, dense or with experts in every layer (neither mlp_only_layers nor
# norm_topk_prob), its published multimodal rotary (interleaved sections: plain RoPE for text positions).
_QWEN3_5_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
_DENSE = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok")
QWEN3_5 = dict({k: v for k, v in QWEN3_NEXT.items() if k not in _DENSE + ("rope_theta", "partial_rotary_factor")},
               **_QWEN3_5_ROPE)
QWEN3_5_MOE = dict({k: v for k, v in QWEN3_NEXT.items() if k not in ("intermediate_size", "rope_theta",
                                                                     "partial_rotary_factor")}, **_QWEN3_5_ROPE)
GATED_DELTA_NET = ("qwen3-next", "qwen3.5", "qwen3.5-moe")  # their layer_types, mtp.* layout and (1 + w) norms


def _families():
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV3Model,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        Glm4MoeModel,
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeTextModel,
        Qwen3_5TextConfig,
        Qwen3_5TextModel,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        Qwen3NextModel,
    )

    return {"deepseek-v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model, DEEPSEEK),
            "glm-4.5": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeModel, GLM),
            "qwen3-next": (Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextModel, QWEN3_NEXT),
            "qwen3.5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5TextModel, QWEN3_5),
            "qwen3.5-moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextModel, QWEN3_5_MOE)}


def _config(name: str, part: str, **change):
    """The config of the main model ("main", L layers, D MTP depths in config.json), of the model whose
    layers L .. L + D - 1 are the depths' ("full"; full attention and MoE, as the depths' layers are),
    or of one depth's layer alone ("depth"); `change` on top."""
    config_class, _, _, values = _families()[name]
    layers = {"main": L, "full": L + D, "depth": 1}[part]
    values = dict(values, num_hidden_layers=layers)
    if name in GATED_DELTA_NET:
        values.update(layer_types=["full_attention"] if part == "depth" else
                      (QWEN3_NEXT_LAYERS + ["full_attention"] * D)[:layers],
                      mtp_num_hidden_layers=D if part == "main" else 0)
    else:
        values.update(num_nextn_predict_layers=D if part == "main" else 0, **({"first_k_dense_replace": 0}
                                                                                if part == "depth" else {}))
    return config_class(**dict(values, **change))


def _mtp_layout(name: str, depth: int) -> dict:
    """Where the checkpoint holds MTP depth `depth` (0-based): its layer's prefix, the names under
    `root`, the embedding, enorm, hnorm, projection, final norm and output layer it reads, and the
    norms' offset (1: Qwen3-Next's and Qwen3.5's scale by 1 + w)."""
    if name in GATED_DELTA_NET:  # one fc and set of norms for all depths; the main model's embedding and head
        return dict(layer=f"mtp.layers.{depth}.", root="mtp.", embedding="model.embed_tokens.weight",
                    enorm="mtp.pre_fc_norm_embedding.weight", hnorm="mtp.pre_fc_norm_hidden.weight",
                    projection="mtp.fc.weight", norm="mtp.norm.weight", head="lm_head.weight", offset=1.0)
    prefix = f"model.layers.{L + depth}."
    return dict(layer=prefix, root=prefix, embedding=prefix + "embed_tokens.weight", enorm=prefix + "enorm.weight",
                hnorm=prefix + "hnorm.weight", projection=prefix + "eh_proj.weight",
                norm=prefix + "shared_head.norm.weight", head=prefix + "shared_head.head.weight", offset=0.0)


def _checkpoint_with_mtp(root: Path, name: str):
    """A model of L layers with D MTP depths in its family's layout: the depths' inner layers are
    layers L .. L + D - 1 of a transformers model of L + D layers (MoE, as their MTP layers are),
    beside random norms and projections and, in DeepSeek-V3's layout, the copies of the embedding
    and output weight its loaders read."""
    from safetensors.torch import save_file

    _, model_class, _, values = _families()[name]
    torch.manual_seed(7)
    full = model_class(_config(name, "full"))
    _randomize(full)
    model = model_class(_config(name, "main"))
    mtp_layers = tuple(f"model.layers.{L + k}." for k in range(D))
    model.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith(mtp_layers)})
    full.save_pretrained(root / f"{name}-full")  # the checkpoint's names (one tensor per expert)
    tensors = _tensors(root / f"{name}-full")
    generator = torch.Generator().manual_seed(8)
    H = values["hidden_size"]
    for k in range(D):
        layout = _mtp_layout(name, k)
        for key in [n for n in tensors if n.startswith(mtp_layers[k])]:
            tensors[layout["layer"] + key[len(mtp_layers[k]):]] = tensors.pop(key)
        for key, value in ((layout["enorm"], 1 + 0.2 * torch.randn(H, generator=generator)),
                           (layout["hnorm"], 1 + 0.2 * torch.randn(H, generator=generator)),
                           (layout["projection"], 0.1 * torch.randn(H, 2 * H, generator=generator)),
                           (layout["norm"], 1 + 0.2 * torch.randn(H, generator=generator)),
                           (layout["head"], tensors["lm_head.weight"].clone()),
                           (layout["embedding"], tensors["model.embed_tokens.weight"].clone())):
            tensors.setdefault(key, value)
    model.save_pretrained(root / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / name / "model.safetensors"),
              metadata={"format": "pt"})
    return model, full, tensors


def _mtp_forward(name: str, tensors: dict, full, depth: int, previous_hidden, next_tokens):
    """MTP depth `depth` (0-based) of the family's engines on the Hugging Face tensors:
    [b, s, h], [b, s] -> (hidden, logits)."""
    _, _, base_class, values = _families()[name]
    layout, eps = _mtp_layout(name, depth), values["rms_norm_eps"]

    def rms_norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (layout["offset"] + weight)

    token = rms_norm(tensors[layout["embedding"]][next_tokens], tensors[layout["enorm"]])
    hidden = rms_norm(previous_hidden, tensors[layout["hnorm"]])
    x = torch.cat([token, hidden], -1) @ tensors[layout["projection"]].T
    layer = base_class(_config(name, "depth")).eval()
    layer.layers[0].load_state_dict(full.model.layers[L + depth].state_dict())
    with torch.no_grad():
        layer.norm.weight.copy_(tensors[layout["norm"]])
        out = layer(inputs_embeds=x).last_hidden_state
    return out, out @ tensors[layout["head"]].T


def _with_mtp(root: Path, name: str) -> dict:
    model, full, tensors = _checkpoint_with_mtp(root, name)
    # this checkpoint stores every expert on its own (transformers' save), which Qwen3.5-MoE's
    # published checkpoints do not: its export asks for that layout (stacked_experts: the published one)
    layout = ("--expert-layout", "per_expert") if name == "qwen3.5-moe" else ()
    out, per_depth = _import_export(root, name, model, *layout)
    with torch.no_grad():
        hidden = model.eval().model(TOKENS).last_hidden_state  # after model.norm
    out["depths"] = len(per_depth)
    for depth in range(min(D, len(per_depth))):
        k = depth + 1
        hidden = hidden[:, : TOKENS.shape[1] - k]
        hidden, logits = _mtp_forward(name, tensors, full, depth, hidden, TOKENS[:, k:])
        out[f"depth {k} logits"] = _rel(per_depth[depth], logits[..., :VOCAB])
    back, prefix = _tensors(root / f"{name}-back"), _mtp_layout(name, 0)["root"]
    out["mtp names"] = sorted(n[len(prefix):] for n in back if n.startswith(prefix))
    return out


def deepseek_v3(root: Path) -> dict:
    """DeepSeek-V3: MLA (q- and kv-LoRA, YaRN with both mscales), a dense first layer, then 8
    sigmoid-routed experts top-2 in 2 groups with an expert bias, a shared expert and a routed
    scaling factor; two MTP depths in DeepSeek-V3's layout."""
    return _with_mtp(root, "deepseek-v3")


def glm_4_5(root: Path) -> dict:
    """GLM-4.5: GQA with QKV biases and q/k RMSNorms, rotary on half of each head, a dense first
    layer, then 4 sigmoid-routed experts top-2 with an expert bias, two shared experts and a
    routed scaling factor; two MTP depths in DeepSeek-V3's layout (GLM-4.5's own)."""
    return _with_mtp(root, "glm-4.5")


def _status(argv: tuple, written: Path) -> dict:
    """A converter run's exit status, its error lines and whether it wrote `written`."""
    status, stderr = _convert(*argv)
    return {"status": status, "stderr": [line for line in stderr.splitlines() if line.strip()],
            "written": written.exists()}


def _refused(root: Path, name: str, cases: dict) -> dict:
    """The import of `name`'s checkpoint under each case's change to its config.json: its exit
    status, its error lines and whether it wrote anything."""
    source, model_class = root / name, _families()[name][1]
    out = {}
    for i, (case, change) in enumerate(cases.items()):
        directory = root / f"refused-{name}-{i}"
        directory.mkdir()
        config = json.loads((source / "config.json").read_text())
        config.update(_config(name, "main", **change).to_dict(), architectures=[model_class.__name__])
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "model.safetensors").symlink_to(source / "model.safetensors")
        target = root / f"refused-{name}-{i}-mg"
        out[case] = _status(("import", str(directory), str(target)), target)
    return out


def refusals(root: Path) -> dict:
    """Configurations megatron-core would route or rotate otherwise: one line each, nothing written."""
    return _refused(root, "deepseek-v3", {
        "norm_topk_prob false": dict(norm_topk_prob=False),
        "top-k over groups not 2": dict(num_experts_per_tok=4, topk_group=1),
        "rope not interleaved": dict(rope_interleave=False),
        "yarn with another original context": dict(rope_scaling=dict(DEEPSEEK["rope_scaling"],
                                                                     original_max_position_embeddings=2048))})


def qwen3_next(root: Path) -> dict:
    """Qwen3-Next: two Gated DeltaNet layers, then a gated full-attention layer with q/k norms and
    rotary on half of each head, every layer's MLP 4 experts top-2 with normalized probabilities and
    a shared expert behind its sigmoid gate, (1 + w) norms; two MTP depths in Qwen3-Next's layout
    (their own layers, one fc and set of norms). Also the layers and rotary share a published
    config.json gives (full_attention_interval, no layer_types or partial_rotary_factor)."""
    from megatron_mtp.serving.config import ModelConfig

    out = _with_mtp(root, "qwen3-next")
    config = json.loads((root / "qwen3-next" / "config.json").read_text())
    published = {k: v for k, v in config.items() if k not in ("layer_types", "partial_rotary_factor")}
    published["rope_parameters"] = {k: v for k, v in (config.get("rope_parameters") or {}).items()
                                    if k != "partial_rotary_factor"}  # (where transformers 5 writes it too)
    cfg = ModelConfig.from_hf(dict(published, full_attention_interval=3), pad_to=128)
    out["published config"] = {"layers": cfg.gdn["layers"], "rotary_percent": cfg.rotary_percent}
    return out


def _qwen3_next_layers_model():
    torch.manual_seed(5)
    model = _families()["qwen3-next"][1](_config(
        "qwen3-next", "main", layer_types=["full_attention", "linear_attention", "full_attention"],
        mlp_only_layers=[0], norm_topk_prob=False, mtp_num_hidden_layers=0))
    _randomize(model)
    return model


def qwen3_next_layers(root: Path) -> dict:
    """Qwen3-Next with layer types no interval describes (full attention first: megatron-core's
    --linear-attention-freq as a list), a dense first layer and softmax before top-k; no MTP."""
    model = _qwen3_next_layers_model()
    model.save_pretrained(root / "qwen3-next-layers")
    return _import_export(root, "qwen3-next-layers", model)[0]


def qwen3_next_bf16(root: Path) -> dict:
    """The same model saved in bf16, as published checkpoints are, and exported in bf16 (its logits
    against the fp32 model with the same bf16 weights and fp32 buffers: the rotary frequencies)."""
    import copy

    model = _qwen3_next_layers_model()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(root / "qwen3-next-bf16")
    return _import_export(root, "qwen3-next-bf16", model, "--dtype", "bf16")[0]


def qwen3_5(root: Path) -> dict:
    """Qwen3.5, dense and MoE (experts in every layer), as transformers' text-only classes build it:
    two Gated DeltaNet layers (in_proj_qkv / z / b / a), then a gated full-attention layer with its
    multimodal rotary on half of each head; two MTP depths in the mtp.* layout. The MoE import is
    also exported as Qwen3-Next (--architecture qwen3_next, the same model stored per key head)."""
    from transformers import AutoModelForCausalLM

    out = {name: _with_mtp(root, name) for name in ("qwen3.5", "qwen3.5-moe")}
    as_next = root / "qwen3.5-moe-as-next"
    out["as qwen3_next"] = _status(("export", str(root / "qwen3.5-moe-mg"), str(as_next), "--architecture",
                                    "qwen3_next"), as_next)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(root / "qwen3.5-moe"), dtype=torch.float32).eval()(TOKENS)
        reloaded = AutoModelForCausalLM.from_pretrained(str(as_next), dtype=torch.float32).eval()(TOKENS)
    out["as qwen3_next"].update(logits=_rel(reloaded.logits, expected.logits),
                                config=json.loads((as_next / "config.json").read_text()))
    return out


def _wrap_vlm(root: Path, name: str) -> Path:
    """`name`'s text-only checkpoint as Qwen3.5's published VLM form: config.json's text_config, the
    language model under model.language_model., mtp.* and lm_head at the top, a (tiny, random) vision
    tower under model.visual."""
    from safetensors.torch import save_file

    text = json.loads((root / name / "config.json").read_text())
    wrapper = {"qwen3.5": "Qwen3_5ForConditionalGeneration", "qwen3.5-moe": "Qwen3_5MoeForConditionalGeneration"}
    config = {"architectures": [wrapper[name]], "model_type": text["model_type"][: -len("_text")],
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "tie_word_embeddings": text["tie_word_embeddings"],
              "vision_config": {"depth": 1, "hidden_size": 16, "out_hidden_size": text["hidden_size"]}}
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in _tensors(root / name).items()}
    generator = torch.Generator().manual_seed(9)
    tensors.update({"model.visual.patch_embed.proj.weight": torch.randn(16, 3, 2, 16, 16, generator=generator),
                    "model.visual.merger.linear_fc2.weight": torch.randn(64, 64, generator=generator)})
    directory = root / f"{name}-vlm"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def qwen3_5_vlm(root: Path) -> dict:
    """The dense Qwen3.5 checkpoint in its published VLM form: transformers' Qwen3_5ForCausalLM
    loads it (the form is the published one); the import takes its language model and MTP depths
    (the same model as the text-only import, bit for bit) and leaves the vision tower out; the export
    is the text-only checkpoint, bit for bit; its output line says what it left out. Without
    text_config it is refused."""
    from transformers import AutoModelForCausalLM

    directory = _wrap_vlm(root, "qwen3.5")
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(root / "qwen3.5"), dtype=torch.float32).eval()(TOKENS)
        wrapped = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()(TOKENS)
    printed = io.StringIO()
    out = {"transformers' logits": _rel(wrapped.logits, expected.logits),
           "import": _convert("import", str(directory), str(root / "qwen3.5-vlm-mg"), printed=printed),
           "printed": printed.getvalue().splitlines()[0]}
    main, per_depth = _runner(root / "qwen3.5-vlm-mg").teacher_forced(TOKENS)
    text_main, text_depths = _runner(root / "qwen3.5-mg").teacher_forced(TOKENS)
    out["same as text-only"] = torch.equal(main, text_main) and all(map(torch.equal, per_depth, text_depths))
    out["logits"] = _rel(main, expected.logits)
    out["export"] = _convert("export", str(root / "qwen3.5-vlm-mg"), str(root / "qwen3.5-vlm-back"))
    out.update(_compared(_tensors(root / "qwen3.5"), _tensors(root / "qwen3.5-vlm-back")))
    out["config"] = json.loads((root / "qwen3.5-vlm-back" / "config.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    del config["text_config"]
    bare = root / "qwen3.5-vlm-bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(config))
    (bare / "model.safetensors").symlink_to(directory / "model.safetensors")
    out["no text_config"] = _status(("import", str(bare), str(root / "qwen3.5-vlm-bare-mg")),
                                    root / "qwen3.5-vlm-bare-mg")
    return out


def qwen3_5_refusals(root: Path) -> dict:
    """What Qwen3.5's classes cannot hold, one line each with nothing written: attention biases on
    import; a Qwen3-Next with a dense layer and softmax before top-k exported as Qwen3.5-MoE; a Qwen3.5
    exported as another family."""
    out = _refused(root, "qwen3.5", {"attention biases": dict(attention_bias=True)})
    for case, source, architecture in (("dense layers as qwen3_5_moe", "qwen3-next-layers-mg", "qwen3_5_moe"),
                                       ("qwen3.5 as qwen3", "qwen3.5-mg", "qwen3"),
                                       ("qwen3.5 as qwen3_next", "qwen3.5-mg", "qwen3_next")):
        target = root / f"refused-{case.replace(' ', '-')}"
        out[case] = _status(("export", str(root / source), str(target), "--architecture", architecture), target)
    return out


def qwen3_next_refusals(root: Path) -> dict:
    """What the Qwen3-Next bridge cannot carry, each one line with nothing written: configs (MTP
    depths on a last Gated DeltaNet layer, value heads not grouped by key head, no shared expert,
    attention biases), an export of MTP depths with their own fc (a third depth added at import,
    newly initialized) in Qwen3-Next's layout, which holds one, and in DeepSeek-V3's layout (whose
    norms scale by w)."""
    out = _refused(root, "qwen3-next", {
        "mtp on a last Gated DeltaNet layer": dict(layer_types=["linear_attention", "full_attention",
                                                                "linear_attention"]),
        "value heads not grouped by key head": dict(linear_num_value_heads=3),
        "no shared expert": dict(shared_expert_intermediate_size=0),
        "attention biases": dict(attention_bias=True)})
    imported = _convert("import", str(root / "qwen3-next"), str(root / "qwen3-next-d3"), "--mtp-num-layers", "3")
    out["depths with their own fc"] = {"import": imported[0], **_status(
        ("export", str(root / "qwen3-next-d3"), str(root / "qwen3-next-d3-back")), root / "qwen3-next-d3-back")}
    out["another family's MTP layout"] = _status(
        ("export", str(root / "qwen3-next-mg"), str(root / "qwen3-next-ds"), "--mtp-layout", "deepseek_v3"),
        root / "qwen3-next-ds")
    return out


def mla_decoding(root: Path) -> dict:
    """Speculative and greedy decoding of the DeepSeek-V3 import over the KV cache (multi-latent
    attention's rotary positions counted from each forward's first) against the whole-sequence
    recompute (tests/bodies/serving.py's check), and eval_speculative.py on it."""
    from tests.bodies.serving import kv_cache
    from tools import eval_speculative

    out = kv_cache(str(root), names=("deepseek-v3-mg",))["deepseek-v3-mg"]
    status, stderr = _run(eval_speculative.main,
                          [str(root / "deepseek-v3-mg"), "--num-prompts", "2", "--new-tokens", "8"])
    out["eval_speculative"] = {"status": status, "stderr": stderr[-2000:]}
    return out


# ---------------------------------------------------------------- stacked experts

# Each MoE family's per-expert test checkpoint (the parts above wrote it and its import) and the
# prefixes of its MTP depths' tensors, which transformers' classes do not hold.
STACKED_FAMILIES = {"qwen3-moe": (), "deepseek-v3": (f"model.layers.{L}.", f"model.layers.{L + 1}."),
                    "glm-4.5": (f"model.layers.{L}.", f"model.layers.{L + 1}."), "qwen3-next": ("mtp.",),
                    "qwen3.5-moe": ("mtp.",)}


def _stack_mtp(tensors: dict) -> dict:
    """The MTP depths' experts stacked as transformers stacks a decoder layer's: gate_up_proj
    [E, 2F, H] (expert e's gate rows, then its up rows), down_proj [E, H, F]."""
    import re

    out, experts = {}, {}
    for name, tensor in tensors.items():
        if m := re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name):
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = tensor
        else:
            out[name] = tensor
    for prefix, parts in experts.items():
        count = len(parts) // 3
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]])
                                                     for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
    return out


def _write_like(root: Path, source: str, name: str, tensors: dict) -> Path:
    from safetensors.torch import save_file

    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text((root / source / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def _megatron_equal(a: Path, b: Path) -> dict:
    from megatron_mtp.serving import files

    _, first, _ = files.read_megatron(str(a))
    _, second, _ = files.read_megatron(str(b))
    return {"tensors": len(first), "names only one side": sorted(set(first) ^ set(second)),
            "differing": sorted(n for n in set(first) & set(second) if not torch.equal(first[n], second[n]))}


def stacked_experts(root: Path) -> dict:
    """Every MoE family's checkpoint with its experts stacked (mlp.experts.gate_up_proj [E, 2F, H],
    down_proj [E, H, F]): the decoder layers as transformers saves them without converting back to
    its per-expert names (save_original_format=False), the MTP depths' per expert ("published":
    Qwen3.5-MoE's published form) or stacked too ("all stacked"). transformers loads the stacked form
    to logits equal to the per-expert original's; the imports equal the per-expert import bit for
    bit; the exports of the all-stacked import give back the original per-expert checkpoint
    (--expert-layout per_expert), the all-stacked one (stacked) and, by default, the family's
    published form, bit for bit (as _compared: the shifted output norms as the model computes them)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, mtp in STACKED_FAMILIES.items():
        result = out[name] = {}
        with torch.no_grad():
            original = AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32).eval()
            original.save_pretrained(root / f"{name}-transformers-stacked", save_original_format=False)
        per_expert = _tensors(root / name)
        decoder = _tensors(root / f"{name}-transformers-stacked")
        depths = {k: v for k, v in per_expert.items() if k.startswith(mtp)} if mtp else {}
        forms = {"published": _write_like(root, name, f"{name}-published", {**decoder, **depths}),
                 "all stacked": _write_like(root, name, f"{name}-all-stacked", {**decoder, **_stack_mtp(depths)})}
        result["stacked names"] = sorted(n for n in _tensors(forms["published"]) if n.endswith("gate_up_proj"))
        with torch.no_grad():
            reloaded = AutoModelForCausalLM.from_pretrained(str(forms["published"]), dtype=torch.float32).eval()
            result["transformers' logits equal"] = torch.equal(reloaded(TOKENS).logits, original(TOKENS).logits)
        for form, directory in forms.items():
            imported = root / f"{directory.name}-mg"
            status = _convert("import", str(directory), str(imported))
            result[form] = {"import": status}
            if status[0] != 0:  # (the part reports the import's error line, as the tests read it)
                return out
            result[form]["as the per-expert import"] = _megatron_equal(root / f"{name}-mg", imported)
        exports = {"default": (), "per_expert": ("--expert-layout", "per_expert"),
                   "stacked": ("--expert-layout", "stacked")}
        for export, flags in exports.items():
            target = root / f"{name}-all-stacked-{export}"
            status = _convert("export", str(root / f"{name}-all-stacked-mg"), str(target), *flags)
            expected = {"per_expert": root / name, "stacked": forms["all stacked"],
                        "default": forms["published"] if name == "qwen3.5-moe" else root / name}[export]
            result[f"export {export}"] = {"export": status, **_compared(_tensors(expected), _tensors(target))}
    return out


def stacked_refusals(root: Path) -> dict:
    """Stacked experts the config does not describe, a layer holding both layouts, and
    --expert-layout on a model without experts: one line each, nothing written."""
    tensors = _tensors(root / "qwen3.5-moe-published")
    prefix = "model.layers.0.mlp.experts."
    cases = {"stack of another size": {**tensors, prefix + "down_proj": tensors[prefix + "down_proj"][:3]},
             "both layouts": {**tensors, **{k: v for k, v in _tensors(root / "qwen3.5-moe").items()
                                           if k.startswith(prefix)}},
             "gate_up_proj alone": {k: v for k, v in tensors.items() if k != prefix + "down_proj"}}
    out = {}
    for i, (case, changed) in enumerate(cases.items()):
        directory = _write_like(root, "qwen3.5-moe", f"stacked-refused-{i}", changed)
        out[case] = _status(("import", str(directory), str(root / f"stacked-refused-{i}-mg")),
                            root / f"stacked-refused-{i}-mg")
    out["dense model"] = _status(("export", str(root / "qwen3.5-mg"), str(root / "dense-stacked"), "--expert-layout",
                                  "stacked"), root / "dense-stacked")
    return out


# ---------------------------------------------------------------- decoding Gated DeltaNet

GDN_IMPORTS = ("qwen3-next-mg", "qwen3.5-mg", "qwen3.5-moe-mg")


def gdn_decoding(root: Path) -> dict:
    """Decoding the Gated DeltaNet imports (Qwen3-Next; Qwen3.5 dense and MoE) over the cache that
    holds each layer's convolution inputs and recurrent state: greedy, Gumbel and speculative
    decoding against tests/reference/speculative.py's whole-sequence recompute (tests/bodies/serving.py's
    kv_cache check: the same tokens, every draft's logits); rejection sampling, each verify step's
    main logits against a whole-sequence forward; the work per step (positions each Gated DeltaNet
    layer runs) after prompts of 4 and 40 tokens, against the recompute's; eval_speculative.py on
    the Qwen3-Next import."""
    from tests.bodies.serving import kv_cache, recurrent_work
    from tools import eval_speculative

    out = kv_cache(str(root), names=GDN_IMPORTS, lengths=(1, 19), new_tokens=16)
    for name in GDN_IMPORTS:
        layers = sum(1 for x in json.loads((root / name.replace("-mg", "") / "config.json").read_text())
                     .get("layer_types", []) if x == "linear_attention")
        out[name].update(recurrent_work(str(root / name), TOKENS[0, :9].tolist()))
        out[name]["gated delta net layers"] = layers
    status, stderr = _run(eval_speculative.main, [str(root / "qwen3-next-mg"), "--num-prompts", "2",
                                                  "--new-tokens", "8"])
    out["eval_speculative"] = {"status": status, "stderr": stderr[-2000:]}
    return out


def frozen(imported: str, trained: str) -> dict:
    """Backbone and MTP tensors of the imported checkpoint against the trained one's."""
    from megatron_mtp.serving import files

    _, before, _ = files.read_megatron(imported)
    _, after, _ = files.read_megatron(trained)
    backbone = [n for n in before if not n.startswith("mtp.")]
    return {"backbone": len(backbone),
            "backbone changed": [n for n in backbone if not torch.equal(before[n], after[n])],
            "mtp changed": [n for n in before if n.startswith("mtp.") and not torch.equal(before[n], after[n])]}


def check(root: str) -> dict:
    """Every part, each reporting its own result or its own traceback."""
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    results = {}
    for name, part in (("qwen3_moe", qwen3_moe), ("deepseek_v3", deepseek_v3), ("glm_4_5", glm_4_5),
                       ("refusals", refusals), ("mla_decoding", mla_decoding), ("qwen3_next", qwen3_next),
                       ("qwen3_next_layers", qwen3_next_layers), ("qwen3_next_bf16", qwen3_next_bf16),
                       ("qwen3_next_refusals", qwen3_next_refusals), ("qwen3_5", qwen3_5), ("qwen3_5_vlm", qwen3_5_vlm),
                       ("qwen3_5_refusals", qwen3_5_refusals), ("gdn_decoding", gdn_decoding),
                       ("stacked_experts", stacked_experts),
                       ("stacked_refusals", stacked_refusals)):
        try:
            results[name] = part(Path(root))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results
