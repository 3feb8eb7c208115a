"""Test bodies of tests/test_bridges.py: Hugging Face's MoE and multi-latent attention families
through tools/convert_checkpoint.py (one process, megatron-core imported once).

References: the `transformers` classes installed here (Qwen3MoeForCausalLM, DeepseekV3ForCausalLM,
Glm4MoeForCausalLM)
on tiny random configs made here, with non-unit norms and a non-zero expert bias; for the
DeepSeek-V3 and GLM-4.5 MTP depths, a forward written from DeepSeek-V3's MTP semantics (enorm of the next
token's embedding, hnorm of the previous depth's hidden state, eh_proj over their concatenation,
one decoder layer, shared_head.norm, shared_head.head) whose decoder layer is transformers'
own (a one-layer DeepseekV3Model / Glm4MoeModel whose final norm is shared_head.norm).
"""

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

from tests.bodies.serving import REPO  # noqa: F401 (puts tools/ on the path)

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


def _convert(*argv: str) -> tuple[int, str]:
    import convert_checkpoint

    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            status = convert_checkpoint.main(list(argv))
        except SystemExit as exit_:
            status = exit_.code
    return status, err.getvalue()


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _randomize(model) -> None:
    """Norms away from 1 and an expert bias away from 0, so a swapped or dropped one shows."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                tensor.normal_(1, 0.2)
            elif name.endswith("e_score_correction_bias"):
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


def _import_export(root: Path, name: str, model, *export_flags: str) -> dict:
    """Import, logits against transformers'; export, tensors and config back, logits again."""
    from transformers import AutoModelForCausalLM

    out = {"import": _convert("import", str(root / name), str(root / f"{name}-mg"))}
    with torch.no_grad():
        expected = model.eval()(TOKENS).logits
    main, per_depth = _runner(root / f"{name}-mg").teacher_forced(TOKENS)
    out["logits"] = _rel(main, expected)
    out["export"] = _convert("export", str(root / f"{name}-mg"), str(root / f"{name}-back"), *export_flags)
    original, back = _tensors(root / name), _tensors(root / f"{name}-back")
    out["names only one side"] = sorted(set(original) ^ set(back))
    out["differing"] = sorted(n for n in set(original) & set(back) if not torch.equal(original[n], back[n]))
    out["tensors"] = len(back)
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


def _families():
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model, Glm4MoeConfig,
                              Glm4MoeForCausalLM, Glm4MoeModel)

    return {"deepseek-v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model, DEEPSEEK),
            "glm-4.5": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeModel, GLM)}


def _checkpoint_with_mtp(root: Path, name: str):
    """A model of L layers with D MTP depths in DeepSeek-V3's layout (GLM-4.5's too): the depths'
    inner layers are layers L .. L + D - 1 of a transformers model of L + D layers (MoE, as their
    MTP layers are), beside random enorm / hnorm / eh_proj / shared_head.norm and the copies of
    the embedding and output weight the loaders read."""
    from safetensors.torch import save_file

    config_class, model_class, _, values = _families()[name]
    torch.manual_seed(7)
    full = model_class(config_class(num_hidden_layers=L + D, num_nextn_predict_layers=0, **values))
    _randomize(full)
    model = model_class(config_class(num_hidden_layers=L, num_nextn_predict_layers=D, **values))
    mtp_layers = tuple(f"model.layers.{L + k}." for k in range(D))
    model.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith(mtp_layers)})
    full.save_pretrained(root / f"{name}-full")  # the checkpoint's names (one tensor per expert)
    tensors = _tensors(root / f"{name}-full")
    generator = torch.Generator().manual_seed(8)
    H = values["hidden_size"]
    for k in range(D):
        prefix = f"model.layers.{L + k}."
        tensors.update({prefix + "enorm.weight": 1 + 0.2 * torch.randn(H, generator=generator),
                        prefix + "hnorm.weight": 1 + 0.2 * torch.randn(H, generator=generator),
                        prefix + "eh_proj.weight": 0.1 * torch.randn(H, 2 * H, generator=generator),
                        prefix + "shared_head.norm.weight": 1 + 0.2 * torch.randn(H, generator=generator),
                        prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                        prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    model.save_pretrained(root / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / name / "model.safetensors"),
              metadata={"format": "pt"})
    return model, full, tensors


def _mtp_forward(name: str, tensors: dict, full, depth: int, previous_hidden, next_tokens):
    """DeepSeek-V3's MTP depth `depth` (0-based; GLM-4.5's is the same) on the Hugging Face
    tensors: [b, s, h], [b, s] -> (hidden, logits)."""
    config_class, _, base_class, values = _families()[name]
    prefix, eps = f"model.layers.{L + depth}.", values["rms_norm_eps"]

    def rms_norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    token = rms_norm(tensors[prefix + "embed_tokens.weight"][next_tokens], tensors[prefix + "enorm.weight"])
    hidden = rms_norm(previous_hidden, tensors[prefix + "hnorm.weight"])
    x = torch.cat([token, hidden], -1) @ tensors[prefix + "eh_proj.weight"].T
    layer = base_class(config_class(**dict(values, num_hidden_layers=1, first_k_dense_replace=0))).eval()
    layer.layers[0].load_state_dict(full.model.layers[L + depth].state_dict())
    with torch.no_grad():
        layer.norm.weight.copy_(tensors[prefix + "shared_head.norm.weight"])
        out = layer(inputs_embeds=x).last_hidden_state
    return out, out @ tensors[prefix + "shared_head.head.weight"].T


def _with_mtp(root: Path, name: str) -> dict:
    model, full, tensors = _checkpoint_with_mtp(root, name)
    out, per_depth = _import_export(root, name, model)
    with torch.no_grad():
        hidden = model.eval()(TOKENS, output_hidden_states=True).hidden_states[-1]  # after model.norm
    out["depths"] = len(per_depth)
    for depth in range(min(D, len(per_depth))):
        k = depth + 1
        hidden = hidden[:, : TOKENS.shape[1] - k]
        hidden, logits = _mtp_forward(name, tensors, full, depth, hidden, TOKENS[:, k:])
        out[f"depth {k} logits"] = _rel(per_depth[depth], logits[..., :VOCAB])
    back = _tensors(root / f"{name}-back")
    out["mtp names"] = sorted(n[len(f"model.layers.{L}."):] for n in back if n.startswith(f"model.layers.{L}."))
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


def refusals(root: Path) -> dict:
    """Configurations megatron-core would route or rotate otherwise: one line each, nothing written."""
    from transformers import DeepseekV3Config

    cases = {"norm_topk_prob false": dict(norm_topk_prob=False),
             "top-k over groups not 2": dict(num_experts_per_tok=4, topk_group=1),
             "rope not interleaved": dict(rope_interleave=False),
             "yarn with another original context": dict(rope_scaling=dict(DEEPSEEK["rope_scaling"],
                                                                          original_max_position_embeddings=2048))}
    source = root / "deepseek-v3"
    out = {}
    for i, (name, change) in enumerate(cases.items()):
        directory = root / f"refused-{i}"
        directory.mkdir()
        config = json.loads((source / "config.json").read_text())
        config.update(DeepseekV3Config(**dict(DEEPSEEK, num_hidden_layers=L, **change)).to_dict())
        config["architectures"] = ["DeepseekV3ForCausalLM"]
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "model.safetensors").symlink_to(source / "model.safetensors")
        status, stderr = _convert("import", str(directory), str(root / f"refused-{i}-mg"))
        out[name] = {"status": status, "stderr": [line for line in stderr.splitlines() if line.strip()],
                     "written": (root / f"refused-{i}-mg").exists()}
    return out


def mla_decoding(root: Path) -> dict:
    """Speculative and greedy decoding of the DeepSeek-V3 import over the KV cache (multi-latent
    attention's rotary positions counted from each forward's first) against the whole-sequence
    recompute (tests/bodies/serving.py's check), and eval_speculative.py on it."""
    import eval_speculative

    from tests.bodies.serving import kv_cache

    out = kv_cache(str(root), names=("deepseek-v3-mg",))["deepseek-v3-mg"]
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            status = eval_speculative.main([str(root / "deepseek-v3-mg"), "--num-prompts", "2", "--new-tokens", "8"])
        except SystemExit as exit_:
            status = exit_.code
    out["eval_speculative"] = {"status": status, "stderr": err.getvalue()[-2000:]}
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
                       ("refusals", refusals), ("mla_decoding", mla_decoding)):
        try:
            results[name] = part(Path(root))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results
