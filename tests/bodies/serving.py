# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Test bodies of tests/test_serving.py (one process each, megatron-core imported once).

Independent references, written from the published models' semantics, in plain PyTorch on
the Hugging Face tensors: a Llama / Qwen2 decoder layer (RMSNorm, GQA with RoPE, SwiGLU),
MiMo's MTP layer (token_layernorm(embedding of the next token), hidden_layernorm(previous
hidden), input_proj(concat[hidden, token]), a decoder layer, final_layernorm, the shared
lm_head) and DeepSeek-V3's (enorm, hnorm, eh_proj(concat[embedding, hidden]), a decoder
layer, shared_head.norm, shared_head.head).
"""

import argparse
import json
from pathlib import Path

import torch

VOCAB, HIDDEN, FFN, HEADS, GROUPS = 257, 64, 96, 4, 2

# The tensor names vLLM's and SGLang's MTP loaders read, as their model code names them
# (vLLM MiMoMTP / SGLang MiMoMTP: model.mtp_layers.{i}; vLLM DeepSeekMTP /
# SGLang DeepseekV3ForCausalLMNextN: model.layers.{L+k}).
DECODER_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
QKV_BIAS = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
MIMO_MTP = ["token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"]
DEEPSEEK_MTP = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "shared_head.head.weight", "embed_tokens.weight"]


# ---------------------------------------------------------------- plain-PyTorch references

def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, theta):  # x [b, heads, s, d], rotate-half convention
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def decoder_layer(x, w, prefix, config):  # x [b, s, h]
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    heads, groups, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    b, s, _ = x.shape

    def linear(name, inp):
        out = inp @ w[prefix + name + ".weight"].T
        return out + w[prefix + name + ".bias"] if prefix + name + ".bias" in w else out

    h = rms_norm(x, w[prefix + "input_layernorm.weight"], eps)
    q = linear("self_attn.q_proj", h).view(b, s, heads, d).transpose(1, 2)
    k = linear("self_attn.k_proj", h).view(b, s, groups, d).transpose(1, 2)
    v = linear("self_attn.v_proj", h).view(b, s, groups, d).transpose(1, 2)
    q, k = rope(q, theta), rope(k, theta)
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    attention = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * d)
    x = x + linear("self_attn.o_proj", attention)
    h = rms_norm(x, w[prefix + "post_attention_layernorm.weight"], eps)
    return x + linear("mlp.down_proj", torch.nn.functional.silu(linear("mlp.gate_proj", h)) * linear("mlp.up_proj", h))


def mimo_mtp(w, config, depth, previous_hidden, next_tokens, carry_pre_norm=False):
    """MiMo's MTP layer `depth`: previous hidden [b, s, h] and the next tokens [b, s] -> (the hidden state
    carried to the next depth: normalized as megatron-core trains it, or before the norm with
    `carry_pre_norm`; logits)."""
    p, eps = f"model.mtp_layers.{depth}.", config["rms_norm_eps"]
    token = rms_norm(w["model.embed_tokens.weight"][next_tokens], w[p + "token_layernorm.weight"], eps)
    hidden = rms_norm(previous_hidden, w[p + "hidden_layernorm.weight"], eps)
    x = torch.cat([hidden, token], -1) @ w[p + "input_proj.weight"].T
    inner = decoder_layer(x, w, p, config)
    x = rms_norm(inner, w[p + "final_layernorm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return inner if carry_pre_norm else x, x @ head.T


def deepseek_mtp(w, config, depth, previous_hidden, next_tokens, carry_pre_norm=False):
    p, eps = f"model.layers.{config['num_hidden_layers'] + depth}.", config["rms_norm_eps"]
    token = rms_norm(w[p + "embed_tokens.weight"][next_tokens], w[p + "enorm.weight"], eps)
    hidden = rms_norm(previous_hidden, w[p + "hnorm.weight"], eps)
    x = torch.cat([token, hidden], -1) @ w[p + "eh_proj.weight"].T
    inner = decoder_layer(x, w, p, config)
    x = rms_norm(inner, w[p + "shared_head.norm.weight"], eps)
    return inner if carry_pre_norm else x, x @ w[p + "shared_head.head.weight"].T


# ---------------------------------------------------------------- tiny Hugging Face models

def _save_hf(directory: Path, config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _random_mimo_depth(config: dict, depth: int, generator) -> dict:
    H, F = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
              "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
              "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
              "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
              "token_layernorm.weight": (H,), "hidden_layernorm.weight": (H,), "input_proj.weight": (H, 2 * H),
              "final_layernorm.weight": (H,)}
    out = {}
    for name, shape in shapes.items():
        value = (1 + 0.1 * torch.randn(shape, generator=generator)) if name.endswith("norm.weight") \
            else 0.1 * torch.randn(shape, generator=generator)
        out[f"model.mtp_layers.{depth}.{name}"] = value
    return out


def make_models(root: str) -> dict:
    """Tiny random Llama (tied, Llama 3 RoPE scaling) and Qwen2 (untied, QKV biases, one MiMo MTP
    depth) checkpoints, and the constructed counting models (below)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root = Path(root)
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=128,
                  rms_norm_eps=1e-6, head_dim=HIDDEN // HEADS)
    llama = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    llama.save_pretrained(root / "llama")
    qwen = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6))
    with torch.no_grad():
        for name, parameter in qwen.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                parameter.normal_(1, 0.1)
    from safetensors.torch import load_file

    qwen.save_pretrained(root / "qwen-plain")
    config = json.loads((root / "qwen-plain" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    config["rope_theta"] = 1e6
    tensors = load_file(str(root / "qwen-plain" / "model.safetensors"))
    tensors.update(_random_mimo_depth({**common, "head_dim": HIDDEN // HEADS}, 0, torch.Generator().manual_seed(1)))
    _save_hf(root / "qwen", config, tensors)
    for wrong in (False, True):
        counting_model(root / ("counting-wrong" if wrong else "counting"), wrong)
    return {"ok": True}


def counting_model(directory: Path, wrong: bool, depths: int = 2) -> Path:
    """A Qwen2 whose every head predicts x + 1 (mod V): the decoder layers add nothing (o_proj and
    down_proj zero), lm_head row y is the embedding of y - 1, so the main head continues a count
    and depth k, fed the embedding of x_{t+k} (input_proj = [0 | I]), drafts x_{t+k+1} exactly.
    `wrong`: input_proj = [I | 0], the halves swapped: the depth reads the previous hidden state
    and drafts x_{t+1} where x_{t+k+1} is due, so no draft is ever accepted."""
    H, F, d = HIDDEN, FFN, HIDDEN // HEADS
    g = torch.Generator().manual_seed(7)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": H,
              "intermediate_size": F, "num_hidden_layers": 2, "num_attention_heads": HEADS,
              "num_key_value_heads": GROUPS, "head_dim": d, "hidden_act": "silu", "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "num_nextn_predict_layers": depths}
    embedding = torch.randn(VOCAB, H, generator=g)
    tensors = {"model.embed_tokens.weight": embedding, "model.norm.weight": torch.ones(H),
               "lm_head.weight": torch.roll(embedding, 1, 0)}

    def layer(prefix):
        out = {}
        for name, shape in (("q", (HEADS * d, H)), ("k", (GROUPS * d, H)), ("v", (GROUPS * d, H))):
            out[f"{prefix}self_attn.{name}_proj.weight"] = 0.1 * torch.randn(shape, generator=g)
            out[f"{prefix}self_attn.{name}_proj.bias"] = 0.1 * torch.randn(shape[:1], generator=g)
        out.update({f"{prefix}self_attn.o_proj.weight": torch.zeros(H, HEADS * d),
                    f"{prefix}mlp.gate_proj.weight": 0.1 * torch.randn(F, H, generator=g),
                    f"{prefix}mlp.up_proj.weight": 0.1 * torch.randn(F, H, generator=g),
                    f"{prefix}mlp.down_proj.weight": torch.zeros(H, F),
                    f"{prefix}input_layernorm.weight": torch.ones(H),
                    f"{prefix}post_attention_layernorm.weight": torch.ones(H)})
        return out

    for i in range(2):
        tensors.update(layer(f"model.layers.{i}."))
    eye, zero = torch.eye(H), torch.zeros(H, H)
    for k in range(depths):
        p = f"model.mtp_layers.{k}."
        tensors.update(layer(p))
        tensors.update({p + "token_layernorm.weight": torch.ones(H), p + "hidden_layernorm.weight": torch.ones(H),
                        p + "final_layernorm.weight": torch.ones(H),
                        p + "input_proj.weight": torch.cat([eye, zero] if wrong else [zero, eye], 1)})
    return _save_hf(directory, config, tensors)


# ---------------------------------------------------------------- bodies

def convert(*argv: str) -> None:
    from tools import convert_checkpoint

    status = convert_checkpoint.main(list(argv))
    assert status == 0, f"convert_checkpoint.py {' '.join(argv)} exited with {status}"


def prepare(root: str) -> dict:
    """The Hugging Face models, and their imports (the Qwen2 one with a second, new MTP depth, for a
    fine-tune at tensor-parallel size 2)."""
    make_models(root)
    convert("import", f"{root}/qwen", f"{root}/qwen-mg", "--mtp-num-layers", "2", "--tensor-model-parallel-size", "2")
    convert("import", f"{root}/qwen", f"{root}/qwen-mg1")  # its own depth only: the round trip
    convert("import", f"{root}/llama", f"{root}/llama-mg")
    for name in ("counting", "counting-wrong"):
        convert("import", f"{root}/{name}", f"{root}/{name}-mg")
    args, _, _ = _megatron(f"{root}/qwen-mg")
    return {"flags": (Path(root) / "qwen-mg" / "megatron_flags.txt").read_text().split(),
            "qwen-mg vocabulary": [args.vocab_size, args.padded_vocab_size]}


def _megatron(path):
    from megatron_mtp.serving import files

    args, tensors, directory = files.read_megatron(path)
    return args, tensors, directory


def _hf(path):
    from safetensors.torch import load_file

    directory = Path(path)
    return json.loads((directory / "config.json").read_text()), load_file(str(directory / "model.safetensors"))


def _runner(path):
    from megatron_mtp.serving import files
    from megatron_mtp.serving import model as serving_model

    args, directory = files.read_arguments(path)
    serving_model.setup()
    model = serving_model.build(args)
    serving_model.load(model, str(directory))
    return serving_model.Runner(model, args.vocab_size)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def parity(root: str) -> dict:
    """Imported Megatron models against transformers; exported MTP depths against MiMo's and
    DeepSeek-V3's MTP forward on the exported tensors."""
    from transformers import AutoModelForCausalLM

    results = {}
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    for name in ("llama", "qwen"):
        reference = AutoModelForCausalLM.from_pretrained(f"{root}/{name}", dtype=torch.float32).eval()
        with torch.no_grad():
            expected = reference(tokens).logits
        _, logits = _runner(f"{root}/{name}-mg").main(tokens)
        assert logits.shape == expected.shape, (logits.shape, expected.shape)
        results[f"{name} logits"] = _rel(logits, expected)
    # MTP: the trained checkpoint's depths, exported, against the references on the exported tensors
    trained = f"{root}/trained"
    runner = _runner(trained)
    main, per_depth = runner.teacher_forced(tokens)
    assert len(per_depth) == 2
    for layout, forward in (("mimo", mimo_mtp), ("deepseek_v3", deepseek_mtp)):
        out = f"{root}/export-{layout}"
        convert("export", trained, out, "--mtp-layout", layout)
        config, w = _hf(out)
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            output = hf(tokens, output_hidden_states=True)
        results[f"{layout} backbone logits"] = _rel(main, output.logits)
        hidden = output.hidden_states[-1]  # after model.norm: what the MTP depths read
        length = tokens.shape[1]
        for depth in range(2):
            k = depth + 1
            hidden = hidden[:, : length - k]
            hidden, logits = forward(w, config, depth, hidden, tokens[:, k:])
            assert logits.shape == per_depth[depth].shape, (logits.shape, per_depth[depth].shape)
            results[f"{layout} depth {k} logits"] = _rel(per_depth[depth], logits)
        # Depth 2 as an engine serving the layout otherwise runs it (docs/serving.md "What the engines
        # run"): the first depth's pre-norm state carried, or the first depth's layer run again.
        first = output.hidden_states[-1][:, : length - 1]
        pre_norm, _ = forward(w, config, 0, first, tokens[:, 1:], carry_pre_norm=True)
        _, logits = forward(w, config, 1, pre_norm[:, : length - 2], tokens[:, 2:])
        results[f"{layout} depth 2 logits, pre-norm state carried"] = _rel(per_depth[1], logits)
        carried, _ = forward(w, config, 0, first, tokens[:, 1:])
        _, logits = forward(w, config, 0, carried[:, : length - 2], tokens[:, 2:])
        results[f"{layout} depth 2 logits, the first depth's layer again"] = _rel(per_depth[1], logits)
    return results


def names(root: str) -> dict:
    """The exported MTP tensors: exactly the loaders' names, with the shapes the config implies."""
    found = {}
    for layout in ("mimo", "deepseek_v3"):
        config, w = _hf(f"{root}/export-{layout}")
        L, H, V = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
        backbone = {n for n in w if not n.startswith("model.mtp_layers.")
                    and not any(n.startswith(f"model.layers.{L + k}.") for k in range(2))}
        expected_backbone = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
            f"model.layers.{i}.{n}" for i in range(L) for n in DECODER_LAYER + QKV_BIAS}
        assert backbone == expected_backbone, sorted(backbone ^ expected_backbone)
        assert config["num_nextn_predict_layers"] == 2
        for k in range(2):
            prefix = f"model.mtp_layers.{k}." if layout == "mimo" else f"model.layers.{L + k}."
            own = {n[len(prefix):]: tuple(t.shape) for n, t in w.items() if n.startswith(prefix)}
            expected = set(DECODER_LAYER + QKV_BIAS + (MIMO_MTP if layout == "mimo" else DEEPSEEK_MTP))
            assert set(own) == expected, (layout, sorted(set(own) ^ expected))
            assert own["input_proj.weight" if layout == "mimo" else "eh_proj.weight"] == (H, 2 * H)
            if layout == "deepseek_v3":
                assert own["shared_head.head.weight"] == own["embed_tokens.weight"] == (V, H)
                assert torch.equal(w[prefix + "shared_head.head.weight"], w["lm_head.weight"])
                assert torch.equal(w[prefix + "embed_tokens.weight"], w["model.embed_tokens.weight"])
        found[layout] = len(w)
    return found


def round_trips(root: str) -> dict:
    out = {}
    # import then export: the Hugging Face tensors and names, bit for bit
    for name, source in (("qwen", "qwen-mg1"), ("llama", "llama-mg")):
        convert("export", f"{root}/{source}", f"{root}/back-{name}")
        _, original = _hf(f"{root}/{name}")
        _, back = _hf(f"{root}/back-{name}")
        assert sorted(original) == sorted(back), sorted(set(original) ^ set(back))
        different = [n for n in original if not torch.equal(original[n], back[n])]
        assert not different, different[:5]
        out[f"{name} import-export tensors"] = len(back)
    # export then import (for the tensor-parallel size it was trained at, which padded its vocabulary):
    # the Megatron parameters, from the TP = 2 x PP = 2 run
    for layout in ("mimo", "deepseek_v3"):
        convert("import", f"{root}/export-{layout}", f"{root}/reimport-{layout}", "--tensor-model-parallel-size", "2")
        _, before, _ = _megatron(f"{root}/trained")
        _, after, _ = _megatron(f"{root}/reimport-{layout}")
        assert sorted(before) == sorted(after), sorted(set(before) ^ set(after))
        different = [n for n in before if not torch.equal(before[n], after[n])]
        assert not different, different[:5]
        out[f"{layout} export-import tensors"] = len(after)
    # bf16: the fp32 tensors rounded
    convert("export", f"{root}/trained", f"{root}/export-bf16", "--dtype", "bf16")
    config, w16 = _hf(f"{root}/export-bf16")
    _, w32 = _hf(f"{root}/export-mimo")
    assert config["torch_dtype"] == "bfloat16" and sorted(w16) == sorted(w32)
    assert all(w16[n].dtype == torch.bfloat16 and torch.equal(w16[n], w32[n].to(torch.bfloat16)) for n in w32)
    return out


def frozen_backbone(root: str) -> dict:
    """The trainer loaded the imported checkpoint at TP = 2 x PP = 2: with the backbone frozen,
    its tensors after training are the imported ones, bit for bit; the MTP depths trained."""
    _, imported, _ = _megatron(f"{root}/qwen-mg")
    _, trained, _ = _megatron(f"{root}/trained")
    backbone = [n for n in imported if not n.startswith("mtp.")]
    assert backbone and all(torch.equal(imported[n], trained[n]) for n in backbone)
    changed = [n for n in imported if n.startswith("mtp.") and not torch.equal(imported[n], trained[n])]
    return {"backbone tensors": len(backbone), "mtp tensors changed": len(changed)}


def speculative_cases(root: str) -> dict:
    """Constructed models: every draft accepted (counting), none (input_proj halves swapped)."""
    from megatron_mtp.serving import speculative

    out = {}
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 17)]
    for name in ("counting", "counting-wrong"):
        runner = _runner(f"{root}/{name}-mg")
        stats = speculative.Stats(depths=2)
        for prompt in prompts:
            output = speculative.speculative(runner, prompt, 20, stats)
            plain = speculative.greedy(runner, prompt, 20)
            assert len(output) == len(plain) == 20 and output == plain, (name, prompt, output, plain)
            assert plain == [(prompt[-1] + i) % VOCAB for i in range(1, 21)], plain  # it counts
            speculative.teacher_forced(runner, [prompt[-1]] + plain, stats)  # a counting text
        out[name] = stats.summary()
    return out


def _captured(main, *argv: str) -> tuple[int, str, str]:
    """A tool's main() in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def evaluate(root: str) -> dict:
    """tools/eval_speculative.py on the trained checkpoint (D = 2): prompts from the run's data; the
    first depth alone; rejection and Gumbel sampling at temperature 0.7; a prompts file encoded by
    the checkpoint's own tokenizer (its data's: bytes); and on the MoE checkpoint (D = 1)."""
    from tools import eval_speculative

    runs = {}
    for name, checkpoint, extra in (("all depths", "trained", ()), ("depth 1", "trained", ("--depths", "1")),
                                    ("moe", "trained-moe", ()),
                                    # more prompts: its acceptance is compared within standard errors
                                    ("rejection", "trained", ("--sampler", "rejection", "--temperature", "0.7",
                                                              "--num-prompts", "16")),
                                    # vLLM's default draft mode: the depths' argmax, accepted with p(d)
                                    ("rejection greedy drafts", "trained",
                                     ("--sampler", "rejection", "--temperature", "0.7", "--num-prompts", "16",
                                      "--draft-sample-method", "greedy")),
                                    ("gumbel", "trained", ("--sampler", "gumbel", "--temperature", "0.7"))):
        out = f"{root}/eval-{name.replace(' ', '-')}.json"
        status, _, stderr = _captured(eval_speculative.main, f"{root}/{checkpoint}", "--num-prompts", "4",
                                      "--prompt-length", "24", "--new-tokens", "24", "--json", out, *extra)
        runs[name] = {"status": status, "stderr": stderr[-2000:],
                      "results": json.loads(Path(out).read_text()) if status == 0 else None}
    prompts = Path(root) / "prompts.txt"
    prompts.write_text("def f(x):\n\n  return x + 1\n")
    status, stdout, stderr = _captured(eval_speculative.main, f"{root}/trained", "--prompts", str(prompts),
                                       "--new-tokens", "8")
    runs["prompts file"] = {"status": status, "stdout": stdout, "stderr": stderr[-2000:]}
    return runs


def eval_refusals(root: str) -> dict:
    """tools/eval_speculative.py on bad input: each one line, exit status 2."""
    from tools import eval_speculative

    trained = f"{root}/trained"
    cases = {
        "missing prompts": (trained, "--prompts", f"{root}/no-such-prompts.txt"),
        "bad tokenizer": (trained, "--prompts", f"{root}/prompts.txt", "--tokenizer", f"{root}/no-such.json"),
        "tokenizer without prompts": (trained, "--tokenizer", "bytes"),
        "greedy temperature": (trained, "--temperature", "0.7"),
        "zero temperature": (trained, "--sampler", "rejection", "--temperature", "0"),
        "draft mode without rejection": (trained, "--draft-sample-method", "greedy"),
    }
    results = {}
    for name, argv in cases.items():
        status, _, stderr = _captured(eval_speculative.main, *argv)
        results[name] = {"status": status, "stderr": [line for line in stderr.splitlines() if line.strip()]}
    return results


def kv_cache(root: str, names=("trained", "qwen-mg", "trained-moe"), lengths=(1, 6, 19), new_tokens=30) -> dict:
    """Speculative and greedy decoding over the KV cache against tests/reference/speculative.py's
    whole-sequence recompute, on the checkpoints `names` under `root` (here the trained checkpoint,
    the imported random Qwen2 (its second depth new) and the MoE checkpoint with an output gate, q/k
    norms and zero-centred norms; tests/bodies/bridges.py's
    DeepSeek-V3 import, multi-latent attention; its Gated DeltaNet imports): the same outputs, and
    every draft's logits (each depth call's last position, in order) within float32 round-off;
    prompts of `lengths` tokens, `new_tokens` decoded."""
    from megatron_mtp.serving import speculative
    from tests.reference import speculative as reference

    class Recorder:  # the runner, recording each depth's logits at the drafting position
        def __init__(self, runner):
            self.runner, self.drafted = runner, []

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def depth(self, k, hidden, ahead, start=0):
            out, logits = self.runner.depth(k, hidden, ahead, start=start)
            self.drafted.append((k, logits[0, -1]))
            return out, logits

    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    results = {}
    for name in names:
        runner = _runner(f"{root}/{name}")
        worst, same, calls = 0.0, True, 0
        sampled_same, sampled_stats = True, speculative.Stats(depths=runner.depths)
        for index, prompt in enumerate(prompts):
            # Sampled (temperature 1, per-position Gumbel noise): the drafts change nothing either.
            sampler = speculative.GumbelSampler(seed=7, sequence=index)
            sampled_same &= speculative.speculative(runner, prompt, new_tokens, sampled_stats, choose=sampler) \
                == speculative.greedy(runner, prompt, new_tokens, choose=sampler)
            cached, recomputed = Recorder(runner), Recorder(runner)
            output = speculative.speculative(cached, prompt, new_tokens, speculative.Stats(depths=runner.depths))
            expected, _ = reference.speculative(recomputed, prompt, new_tokens, runner.depths)
            same &= output == expected
            same &= speculative.greedy(runner, prompt, new_tokens) == reference.greedy(runner, prompt, new_tokens)
            same &= [k for k, _ in cached.drafted] == [k for k, _ in recomputed.drafted]
            calls += len(recomputed.drafted)
            same &= len(cached.drafted) == len(recomputed.drafted)
            worst = max([worst] + [_rel(a, b) for (_, a), (_, b) in zip(cached.drafted, recomputed.drafted)])
        results[name] = {"same": same, "draft calls": calls, "worst": worst, "sampled same": sampled_same,
                         "sampled accepted": sum(sampled_stats.accepted_per_position)}
    return results


class Counting:
    """A Runner whose main-head forwards are recorded: (start, positions, positions each Gated
    DeltaNet layer ran, the logits) and, with `recompute`, the same positions' logits of a
    whole-sequence forward from position 0 on a second Runner."""

    def __init__(self, runner, recompute=None):
        self.runner, self.recompute, self.tokens, self.calls = runner, recompute, [], []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def main(self, tokens, start=0):
        before = self.runner.cache.recurrent_positions.get("main", 0)
        hidden, logits = self.runner.main(tokens, start=start)
        self.tokens = self.tokens[:start] + tokens[0].tolist()
        call = {"start": start, "positions": tokens.shape[1],
                "layer positions": self.runner.cache.recurrent_positions["main"] - before}
        if self.recompute is not None:
            _, whole = self.recompute.main(torch.tensor([self.tokens]))
            call["against whole"] = _rel(logits[0], whole[0, start:])
        self.calls.append(call)
        return hidden, logits


def recurrent_work(path: str, prompt: list) -> dict:
    """A checkpoint with Gated DeltaNet layers decoded over its cached convolution inputs and
    recurrent states (kv_cache checks greedy and Gumbel decoding): rejection sampling after
    `prompt`, each verify step's main logits against a whole-sequence forward ("rejection"); the
    work per step (positions each Gated DeltaNet layer runs) after prompts of 4 and 40 tokens,
    against tests/reference/speculative.py's recompute ("work")."""
    from megatron_mtp.serving import speculative
    from tests.reference import speculative as reference

    runner = _runner(path)
    sampler = speculative.RejectionSampler(seed=3, sequence=0, temperature=0.8)
    checked = Counting(runner, recompute=_runner(path))
    tokens = speculative.speculative(checked, prompt, 16, speculative.Stats(runner.depths), choose=sampler)
    out = {"rejection": {"tokens": len(tokens), "worst": max(c["against whole"] for c in checked.calls),
                         "verify steps": len(checked.calls) - 1}}
    generator = torch.Generator().manual_seed(12)
    work = {}
    for length in (4, 40):
        prompt = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        cached = Counting(runner)
        speculative.speculative(cached, prompt, 12, speculative.Stats(runner.depths))
        recomputed = Counting(runner)
        reference.speculative(recomputed, prompt, 12, runner.depths)
        work[length] = {"cached": [(c["positions"], c["layer positions"]) for c in cached.calls[1:]],
                        "recomputed": [c["layer positions"] for c in recomputed.calls[1:]]}
    out["work"] = work
    return out


def hybrid(root: str) -> dict:
    """The HybridModel checkpoint (Gated DeltaNet layers in the decoder and in each MTP depth):
    kv_cache's and recurrent_work's checks; eval_speculative.py on it, greedy and with rejection
    sampling; a pattern with Mamba layers refused in one line."""
    from megatron_mtp.serving import ServingError
    from megatron_mtp.serving import model as serving_model
    from tools import eval_speculative

    out = kv_cache(root, names=("trained-hybrid",), lengths=(1, 19), new_tokens=16)["trained-hybrid"]
    out.update(recurrent_work(f"{root}/trained-hybrid", torch.randint(
        0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()))
    try:  # Mamba layers: their state is not in the cache (and they need Transformer Engine)
        serving_model.check_buildable(argparse.Namespace(hybrid_layer_pattern="M*M-/*-"))
    except ServingError as error:
        out["mamba refusal"] = str(error)
    for sampler in ("greedy", "rejection"):
        status, stdout, stderr = _captured(eval_speculative.main, f"{root}/trained-hybrid", "--num-prompts", "2",
                                           "--new-tokens", "8", "--sampler", sampler)
        out[f"eval_speculative {sampler}"] = {"status": status, "stdout": stdout, "stderr": stderr[-2000:]}
    return out


def mimo(root: str) -> dict:
    """A published MiMo checkpoint's config (MiMoForCausalLM, model_type mimo: Qwen2 plus
    model.mtp_layers) imports as the Qwen2 one does and exports as MiMo again; --architecture mimo
    writes that config for a trainer checkpoint; contradictions are refused in one line."""
    import shutil

    source = Path(root) / "mimo"
    shutil.copytree(Path(root) / "qwen", source)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo")
    (source / "config.json").write_text(json.dumps(config))
    out = {"import": _convert_captured("import", str(source), f"{root}/mimo-mg")[0]}
    _, mimo_tensors, _ = _megatron(f"{root}/mimo-mg")
    _, qwen_tensors, _ = _megatron(f"{root}/qwen-mg1")
    out["same as qwen2's import"] = sorted(mimo_tensors) == sorted(qwen_tensors) and all(
        torch.equal(mimo_tensors[n], qwen_tensors[n]) for n in qwen_tensors)
    out["export"] = _convert_captured("export", f"{root}/mimo-mg", f"{root}/mimo-back")[0]
    back_config, back = _hf(f"{root}/mimo-back")
    _, original = _hf(str(source))
    out["exported config"] = [back_config["architectures"], back_config["model_type"],
                              back_config.get("num_nextn_predict_layers")]
    out["round trip"] = sorted(back) == sorted(original) and all(torch.equal(back[n], original[n]) for n in original)
    # the export as written loads in transformers (model_type qwen2: transformers has no `mimo`), as the
    # Qwen2 it is: its logits are the original Qwen2's
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(f"{root}/mimo-back", dtype=torch.float32).eval()
        reference = AutoModelForCausalLM.from_pretrained(f"{root}/qwen", dtype=torch.float32).eval()
        out["transformers loads the export"] = [type(loaded).__name__, _rel(loaded(tokens).logits,
                                                                            reference(tokens).logits)]
    out["trained as mimo"] = _convert_captured("export", f"{root}/trained", f"{root}/trained-mimo",
                                       "--architecture", "mimo")[0]
    config = json.loads((Path(root) / "trained-mimo" / "config.json").read_text())
    out["trained config"] = [config["architectures"], config["model_type"], config["num_nextn_predict_layers"]]
    refusals = {"llama as mimo": ("export", f"{root}/llama-mg", f"{root}/no-1", "--architecture", "mimo"),
                "mimo in deepseek layout": ("export", f"{root}/trained", f"{root}/no-2", "--architecture", "mimo",
                                            "--mtp-layout", "deepseek_v3")}
    out["refusals"] = {}
    for name, argv in refusals.items():
        status, _, stderr = _convert_captured(*argv)
        out["refusals"][name] = {"status": status, "stderr": [line for line in stderr.splitlines() if line.strip()],
                                 "written": _leftovers(Path(root), argv[2].rsplit("/", 1)[1])}
    return out


def qwen3(root: str) -> dict:
    """A tiny random Qwen3 (q/k RMSNorms with non-unit weights, head_dim 24, not hidden / heads):
    imported, its logits against transformers'; exported, the original tensors and config back."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=1e6))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1, 0.2)
    model.save_pretrained(Path(root) / "qwen3")
    out = {"import": _convert_captured("import", f"{root}/qwen3", f"{root}/qwen3-mg")[0]}
    out["flags"] = (Path(root) / "qwen3-mg" / "megatron_flags.txt").read_text().split()
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model.eval()(tokens).logits
    _, logits = _runner(f"{root}/qwen3-mg").main(tokens)
    out["logits"] = _rel(logits, expected)
    out["export"] = _convert_captured("export", f"{root}/qwen3-mg", f"{root}/qwen3-back")[0]
    back_config, back = _hf(f"{root}/qwen3-back")
    _, original = _hf(f"{root}/qwen3")
    out["exported config"] = [back_config["architectures"], back_config["model_type"], back_config["head_dim"]]
    out["round trip"] = sorted(back) == sorted(original) and all(torch.equal(back[n], original[n]) for n in original)
    reloaded = AutoModelForCausalLM.from_pretrained(f"{root}/qwen3-back", dtype=torch.float32).eval()
    with torch.no_grad():
        out["export's logits"] = _rel(reloaded(tokens).logits, expected)
    return out


def staging(root: str) -> dict:
    """An import whose check after writing fails (a backbone parameter left to its initialization):
    one line, exit status 2, and nothing in place of the output."""
    from megatron_mtp.serving import mapping

    original = mapping.hf_to_megatron

    def dropping(*args, **kwargs):  # loses one backbone tensor: the model keeps its fresh initialization
        tensors = original(*args, **kwargs)
        tensors.pop("decoder.final_layernorm.weight")
        return tensors

    mapping.hf_to_megatron = dropping
    try:
        status, _, stderr = _convert_captured("import", f"{root}/qwen", f"{root}/dropped")
    finally:
        mapping.hf_to_megatron = original
    return {"status": status, "stderr": [line for line in stderr.splitlines() if line.strip()],
            "written": _leftovers(Path(root), "dropped")}


def _pit_bins(p: torch.Tensor, key: torch.Tensor, drawn_from: torch.Tensor, bins: int) -> torch.Tensor:
    """The probability that a token drawn from `drawn_from` has its randomized probability integral
    transform under p (tokens ordered by `key`, largest first; u uniform over the token's slice
    [F(x-), F(x)] of p's cumulative distribution) in each of `bins` equal bins of [0, 1)."""
    order = torch.argsort(key, descending=True)
    mass = p[order]
    start = torch.cumsum(mass, 0) - mass
    edges = torch.arange(bins + 1, dtype=torch.float64) / bins
    overlap = (torch.minimum(start + mass, edges[1:, None]) - torch.maximum(start, edges[:-1, None])).clamp(min=0)
    return (overlap * drawn_from[order] / mass.clamp(min=1e-300)).sum(1)


def rejection(root: str, samples: int = 1000, temperature: float = 0.4, bins: int = 10, level: float = 0.01) -> dict:
    """Rejection sampling on the trained checkpoint (D = 2, temperature 0.4: a draft is accepted with
    probability sum min(p, q), about 0.8 here): `samples` decodes of 3 tokens after one prompt, and each
    text teacher-forced from position 0 (no cache) for the plain model's p and the depths' q. The
    second token (depth 1's draft, or the recovered token) and the third (depth 2's, the recovered or
    the next step's) are each lossless when their probability integral transform under p, given the
    tokens before, is uniform: Pearson's chi-square over 10 bins at level / 2 each (Bonferroni: at
    most `level` for both). The tokens are ordered by q / p (depth 1's q for the second, depth 2's for
    the third), so that a verifier biased toward the drafts moves mass to low bins; the power of the
    second token's test against each broken verifier (recovery from p; acceptance with p(d)) comes
    from their exact distributions of that token given the sampled first one (the prefill's, drawn
    from p alike)."""
    from megatron_mtp.serving import speculative
    from tests.harness import chi_square

    runner = _runner(f"{root}/trained")
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(13)).tolist()
    anchor = len(prompt) - 1  # the last prompt position: depth k there drafts the (k + 1)-th new token
    stats = speculative.Stats(depths=2)
    uniform = torch.Generator().manual_seed(17)
    transforms = {2: [], 3: []}
    alternatives = {"recover from p": torch.zeros(bins, dtype=torch.float64),
                    "accept with p": torch.zeros(bins, dtype=torch.float64)}
    alpha = 0.0
    for sequence in range(samples):
        sampler = speculative.RejectionSampler(seed=19, sequence=sequence, temperature=temperature)
        text = prompt + speculative.speculative(runner, prompt, 3, stats, choose=sampler)
        main, per_depth = runner.teacher_forced(torch.tensor([text]))
        for new, depth in ((2, 1), (3, 2)):
            position = len(prompt) + new - 1
            p = torch.softmax(main[0, position - 1].double() / temperature, -1)
            q = torch.softmax(per_depth[depth - 1][0, anchor].double() / temperature, -1)
            order = torch.argsort(q / p, descending=True)
            rank = int((order == text[position]).nonzero())
            below = float(p[order[:rank]].sum())
            transforms[new].append(below + float(torch.rand((), generator=uniform, dtype=torch.float64)) *
                                   float(p[text[position]]))
            if new == 2:
                overlap = torch.minimum(p, q)
                alpha += float(overlap.sum()) / samples
                residual = (p - q).clamp(min=0)
                alternatives["recover from p"] += _pit_bins(p, q / p, overlap + (1 - overlap.sum()) * p, bins) / samples
                alternatives["accept with p"] += _pit_bins(
                    p, q / p, q * p + (1 - (q * p).sum()) * residual / residual.sum(), bins) / samples
    null = torch.full((bins,), 1.0 / bins, dtype=torch.float64)
    threshold = chi_square.critical_value(bins - 1, level / 2)
    out = {"threshold": threshold, "alpha": alpha, "acceptance": stats.summary(),
           "power": {name: chi_square.power(null, bins_, samples, level / 2) for name, bins_ in alternatives.items()}}
    for new, values in transforms.items():
        counts = torch.bincount((torch.tensor(values) * bins).long().clamp(max=bins - 1), minlength=bins)
        out[f"token {new}"] = chi_square.statistic(counts, null)
    return out


def check(root: str) -> dict:
    """Every part's result, or the traceback of the part that failed (the others still run: a test
    fails with its own part's error). `names` and `round trips` read the exports `parity` writes."""
    import traceback

    results = {}
    for name, part in (("parity", parity), ("names", names), ("round trips", round_trips),
                       ("frozen backbone", frozen_backbone), ("speculative", speculative_cases),
                       ("kv cache", kv_cache), ("evaluate", evaluate), ("eval refusals", eval_refusals),
                       ("mimo", mimo), ("qwen3", qwen3), ("staging", staging), ("rejection", rejection),
                       ("hybrid", hybrid)):
        try:
            results[name] = part(root)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results



# ---------------------------------------------------------------- a repeated MTP layer

def _convert_captured(*argv: str) -> tuple[int, str, str]:
    """tools/convert_checkpoint.py in this process: (exit status, stdout, stderr)."""
    from tools import convert_checkpoint

    return _captured(convert_checkpoint.main, *argv)


def _leftovers(root: Path, name: str) -> bool:
    return (root / name).exists() or any(p.name.startswith(f".{name}.partial-") for p in root.iterdir())


def _layer_names(tensors: dict) -> list:
    return sorted({".".join(n.split(".")[:3]) for n in tensors if n.startswith("mtp.")})


def _repeated_export(root: Path, trained: str, layout: str, dtype: str, forward, tokens, before: dict,
                     teacher_forced) -> dict:
    """Export the repeated checkpoint in `layout` at `dtype`, import it back with
    --mtp-use-repeated-layer, and run the exported depths as `forward` (MiMo's / DeepSeek-V3's)."""
    from transformers import AutoModelForCausalLM

    name = f"export-repeated-{layout}-{dtype}"
    out = root / name
    try:
        status, said, _ = _convert_captured("export", trained, str(out), "--mtp-layout", layout, "--dtype", dtype)
    except Exception as error:  # not a one-line refusal: the converter raised
        return {"status": None, "error": f"{type(error).__name__}: {' '.join(str(error).split())[:400]}",
                "written": _leftovers(root, name)}
    config, w = _hf(str(out))
    w = {k: v.float() for k, v in w.items()}  # bf16 holds values exactly representable in fp32
    L = config["num_hidden_layers"]
    prefixes = [f"model.mtp_layers.{k}." if layout == "mimo" else f"model.layers.{L + k}." for k in range(3)]
    depth_names = [{n[len(p):] for n in w if n.startswith(p)} for p in prefixes]
    entry = {"status": status, "said": said, "num_nextn_predict_layers": config.get("num_nextn_predict_layers"),
             "depth tensors": [len(names) for names in depth_names],
             "depths differ in": sorted(s for s in depth_names[0] & depth_names[1]
                                        if not torch.equal(w[prefixes[0] + s], w[prefixes[1] + s]))}
    # back as one repeated layer: the trained tensors (rounded to bf16 when exported so), bit for bit
    back = root / f"reimport-repeated-{layout}-{dtype}"
    status, _, stderr = _convert_captured("import", str(out), str(back), "--mtp-use-repeated-layer",
                                          "--make-vocab-size-divisible-by", "1")
    if status != 0:
        entry["round trip"] = {"status": status, "stderr": stderr.strip().splitlines()[-1:]}
        return entry
    args, after, _ = _megatron(str(back))
    expected = before if dtype == "fp32" else {n: t.to(torch.bfloat16).float() for n, t in before.items()}
    entry["round trip"] = {
        "status": status, "names only before": sorted(set(expected) - set(after)),
        "names only after": sorted(set(after) - set(expected)), "tensors": len(after),
        "differing": sorted(n for n in set(expected) & set(after) if not torch.equal(expected[n], after[n])),
        "args": [args.mtp_num_layers, args.mtp_use_repeated_layer],
        "flags": (back / "megatron_flags.txt").read_text().split()}
    # the exported depths, run as MiMo's / DeepSeek-V3's MTP forward on the exported tensors, against
    # the model they hold (fp32: the trained model; bf16: its re-import, the trained weights rounded)
    main, per_depth = teacher_forced(trained if dtype == "fp32" else str(back))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        output = hf(tokens, output_hidden_states=True)
    entry["parity"] = {"backbone logits": _rel(main, output.logits)}
    hidden = output.hidden_states[-1]
    for depth in range(2):
        k = depth + 1
        hidden = hidden[:, : tokens.shape[1] - k]
        hidden, logits = forward(w, config, depth, hidden, tokens[:, k:])
        assert logits.shape == per_depth[depth].shape, (logits.shape, per_depth[depth].shape)
        entry["parity"][f"depth {k} logits"] = _rel(per_depth[depth], logits)
    return entry


def repeated_layer(root: str) -> dict:
    """A checkpoint trained with --mtp-use-repeated-layer (D = 2, one MTP layer at every depth):
    exported in both layouts at fp32 and bf16 and imported back; imported without
    --mtp-use-repeated-layer; an export whose depths differ imported as one repeated layer."""
    from safetensors.torch import save_file

    root = Path(root)
    trained = str(root / "trained-repeated")
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    runner = _runner(trained)
    _, before, _ = _megatron(trained)
    results = {"runner": {"repeated": runner.repeated, "depths": runner.depths},
               "trained mtp layers": _layer_names(before)}

    def teacher_forced(path):
        return _runner(path).teacher_forced(tokens)

    for dtype in ("fp32", "bf16"):
        results[dtype] = {layout: _repeated_export(root, trained, layout, dtype, forward, tokens, before,
                                                   teacher_forced)
                          for layout, forward in (("mimo", mimo_mtp), ("deepseek_v3", deepseek_mtp))}
    source = root / "export-repeated-mimo-bf16"
    rounded = {n: t.to(torch.bfloat16).float() for n, t in before.items()}
    # without --mtp-use-repeated-layer: two distinct layers, each the trained layer
    status, _, _ = _convert_captured("import", str(source), str(root / "reimport-distinct"),
                                     "--make-vocab-size-divisible-by", "1")
    args, distinct, _ = _megatron(str(root / "reimport-distinct"))
    layer = {n[len("mtp.layers.0."):]: t for n, t in rounded.items() if n.startswith("mtp.layers.0.")}
    results["distinct import"] = {
        "status": status, "args": [args.mtp_num_layers, args.mtp_use_repeated_layer],
        "layers": _layer_names(distinct),
        "differing": sorted(f"mtp.layers.{k}.{s}" for k in range(2) for s, t in layer.items()
                            if not torch.equal(distinct.get(f"mtp.layers.{k}.{s}", torch.empty(0)), t))}
    # an export whose second depth differs from its first in one tensor, imported as one repeated layer
    config, w = _hf(str(source))
    w["model.mtp_layers.1.mlp.up_proj.weight"] = w["model.mtp_layers.1.mlp.up_proj.weight"] * 2
    differing = root / "repeated-differing"
    differing.mkdir()
    (differing / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(differing / "model.safetensors"))
    status, _, stderr = _convert_captured("import", str(differing), str(root / "reimport-differing"),
                                          "--mtp-use-repeated-layer", "--make-vocab-size-divisible-by", "1")
    results["differing depths"] = {"status": status, "stderr": [line for line in stderr.splitlines() if line.strip()],
                                   "written": _leftovers(root, "reimport-differing")}
    return results


def example_export(trained: str, out: str) -> dict:
    """An example config's trained checkpoint exported with its family's defaults, loaded by
    transformers, and its logits against this checkpoint's own (the serving model's)."""
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        convert("export", trained, out)
    config, _ = _hf(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, config["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(5))
    _, logits = _runner(trained).main(tokens)
    with torch.no_grad():
        expected = hf(tokens).logits
    return {"architectures": config["architectures"], "logits": _rel(logits, expected), "printed": printed.getvalue()}
