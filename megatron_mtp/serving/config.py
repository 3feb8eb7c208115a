"""The model both sides describe: a Llama, Qwen2 or Qwen3 decoder (GQA, RMSNorm, SwiGLU, RoPE;
Qwen2's QKV biases, Qwen3's per-head q/k RMSNorm) with D MTP depths, read from a Hugging Face config.json or from a trainer checkpoint's arguments,
and written back to either (config.json, the trainer's flags, the arguments a checkpoint holds).
"""

import argparse
import math
from dataclasses import asdict, dataclass, field

from megatron_mtp.serving import ServingError

# MiMo (model_type "mimo") is Qwen2 with MTP depths in model.mtp_layers; its own name in config.json
# is what makes vLLM and SGLang serve those depths (their MiMo MTP models).
FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MiMoForCausalLM": "mimo",
            "Qwen3ForCausalLM": "qwen3"}
ARCHITECTURES = {family: architecture for architecture, family in FAMILIES.items()}
QKV_BIAS_FAMILIES = ("qwen2", "mimo")
QK_NORM_FAMILIES = ("qwen3",)  # an RMSNorm of each head's query and key (megatron-core's --qk-layernorm)
# megatron-core's Llama 3 RoPE scaling has these constants built in (rotary_pos_embedding._apply_scaling).
LLAMA3_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class ModelConfig:
    family: str  # "llama" | "qwen2" | "mimo" (Qwen2-shaped) | "qwen3"
    vocab_size: int  # the tokenizer's vocabulary (Hugging Face's vocab_size)
    padded_vocab_size: int  # rows of megatron-core's embedding and output layer
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", "factor": F, ...}
    qk_layernorm: bool = False
    mtp_num_layers: int = 0
    mtp_repeated: bool = False
    attention_dropout: float = 0.0  # Llama's and Qwen2's; neither has hidden dropout
    extra: dict = field(default_factory=dict)  # bos/eos ids etc., carried through

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf(cls, config: dict, pad_to: int = 128) -> "ModelConfig":
        architectures = config.get("architectures") or []
        known = [a for a in architectures if a in FAMILIES]
        if not known:
            raise ServingError(f"unknown architecture {architectures or config.get('model_type')!r}: "
                               f"import reads {' or '.join(FAMILIES)}")
        family = FAMILIES[known[0]]
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            vocab = int(config["vocab_size"])
            values = dict(
                family=family, vocab_size=vocab, padded_vocab_size=math.ceil(vocab / pad_to) * pad_to,
                hidden_size=hidden, ffn_hidden_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
                num_query_groups=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=family in QKV_BIAS_FAMILIES, qk_layernorm=family in QK_NORM_FAMILIES,
            )
        except KeyError as missing:
            raise ServingError(f"config.json has no {missing.args[0]!r}") from None
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ServingError(f"config.json: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
        if family == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise ServingError("config.json: Llama attention_bias / mlp_bias are not supported")
        if family == "qwen3" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise ServingError("config.json: Qwen3 attention_bias is not supported")
        if family != "llama" and config.get("use_sliding_window"):
            raise ServingError(f"config.json: {ARCHITECTURES[family]} sliding-window attention is not supported")
        if heads % values["num_query_groups"]:
            raise ServingError(f"config.json: num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {values['num_query_groups']}")
        # transformers 5 writes rope_parameters; 4.x (and most published checkpoints) rope_theta / rope_scaling
        parameters = config.get("rope_parameters") or {}
        theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling")
        if parameters.get("rope_type", "default") != "default":
            scaling = parameters
        values["rope_theta"] = float(theta)
        values["rope_scaling"] = _rope_scaling(scaling)
        values["mtp_num_layers"] = int(config.get("num_nextn_predict_layers") or 0)
        values["extra"] = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        values["attention_dropout"] = float(config.get("attention_dropout") or 0.0)
        return cls(**values)

    def to_hf(self, dtype: str, mtp_layout: str | None) -> dict:
        config = {
            "architectures": [ARCHITECTURES[self.family]], "model_type": self.family,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim, "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon, "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tied, "attention_dropout": self.attention_dropout, "initializer_range": 0.02,
            "use_cache": True, "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        }
        if self.family == "llama":
            config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        elif self.family == "qwen3":
            config.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                          max_window_layers=self.num_layers)
        else:
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        config.update(self.extra)
        if mtp_layout and self.mtp_num_layers:
            config["num_nextn_predict_layers"] = self.mtp_num_layers
        return config

    # ------------------------------------------------------------------ Megatron

    @classmethod
    def from_megatron_args(cls, args) -> "ModelConfig":
        """A trainer checkpoint's arguments; refused (one line) unless the model is Llama-, Qwen2- or
        Qwen3-shaped (q/k norms without QKV biases)."""
        def get(name, default=None):
            return getattr(args, name, default)

        problems = []
        if get("normalization") != "RMSNorm":
            problems.append(f"--normalization {get('normalization')} (needs RMSNorm)")
        if not get("swiglu"):
            problems.append("no --swiglu (needs SwiGLU)")
        if get("add_bias_linear", True):
            problems.append("linear biases (needs --disable-bias-linear)")
        if get("position_embedding_type") != "rope" or get("rotary_percent", 1.0) != 1.0 or get("rotary_interleaved"):
            problems.append("positions other than full, non-interleaved RoPE")
        if get("qk_layernorm") and get("add_qkv_bias"):
            problems.append("--qk-layernorm with --add-qkv-bias (Qwen3 has q/k norms, Qwen2 QKV biases)")
        for flag in ("qk_l2_norm", "layernorm_zero_centered_gamma", "apply_layernorm_1p", "num_experts",
                     "multi_latent_attention", "squared_relu", "attention_output_gate"):
            if get(flag):
                problems.append(f"--{flag.replace('_', '-')}")
        if problems:
            raise ServingError("the checkpoint's model is not Llama-, Qwen2- or Qwen3-shaped, it has "
                               + ", ".join(problems))
        heads = get("num_attention_heads")
        groups = get("num_query_groups") if get("group_query_attention") else heads
        scaling = None
        if get("use_rope_scaling"):
            scaling = dict(rope_type="llama3", factor=float(get("rope_scaling_factor")), **LLAMA3_CONSTANTS)
        elif get("rotary_seq_len_interpolation_factor"):
            scaling = dict(rope_type="linear", factor=float(get("rotary_seq_len_interpolation_factor")))
        serving = dict(get("serving_extra") or {})
        vocab_size = int(get("vocab_size") or get("padded_vocab_size"))
        if get("tokenizer_type") == "NullTokenizer" and get("null_tokenizer_eod_id") is not None:
            eod = int(get("null_tokenizer_eod_id"))
            serving = serving or {"eos_token_id": eod}
            # the end-of-document id may lie past --vocab-size's ids (Megatron-LM's NullTokenizer convention
            # eod = vocab_size): its row is the tokenizer's too
            vocab_size = max(vocab_size, min(eod + 1, int(get("padded_vocab_size"))))
        family = "qwen2" if get("add_qkv_bias") else "qwen3" if get("qk_layernorm") else "llama"
        if family == "qwen2" and get("serving_family") == "mimo":  # imported from MiMo: exported as MiMo
            family = "mimo"
        return cls(
            family=family, vocab_size=vocab_size,
            padded_vocab_size=int(get("padded_vocab_size")), hidden_size=int(get("hidden_size")),
            ffn_hidden_size=int(get("ffn_hidden_size")), num_layers=int(get("num_layers")),
            num_attention_heads=int(heads), num_query_groups=int(groups),
            head_dim=int(get("kv_channels") or get("hidden_size") // heads),
            norm_epsilon=float(get("layernorm_epsilon", get("norm_epsilon", 1e-5))),
            rope_theta=float(get("rotary_base", 10000)), max_position_embeddings=int(get("max_position_embeddings")),
            tied=not get("untie_embeddings_and_output_weights"), qkv_bias=bool(get("add_qkv_bias")),
            qk_layernorm=bool(get("qk_layernorm")),
            rope_scaling=scaling, mtp_num_layers=int(get("mtp_num_layers") or 0),
            mtp_repeated=bool(get("mtp_use_repeated_layer")), extra=serving,
            attention_dropout=float(get("attention_dropout") or 0.0),
        )

    def as_architecture(self, name: str) -> None:
        """Export as `name` (llama, qwen2, mimo, qwen3) instead of the family the model's shape names."""
        if (name in QK_NORM_FAMILIES) != self.qk_layernorm:
            raise ServingError(f"--architecture {name}: {ARCHITECTURES[name]} "
                               f"{'has' if name in QK_NORM_FAMILIES else 'has no'} q/k norms, the model "
                               f"{'has' if self.qk_layernorm else 'has none'}")
        if (name in QKV_BIAS_FAMILIES) != self.qkv_bias:
            raise ServingError(f"--architecture {name}: {ARCHITECTURES[name]} "
                               f"{'has' if name in QKV_BIAS_FAMILIES else 'has no'} QKV biases, the model "
                               f"{'has' if self.qkv_bias else 'has none'}")
        self.family = name

    def megatron_args(self) -> argparse.Namespace:
        """The model's arguments as megatron.training names them (what an imported checkpoint holds)."""
        scaling = self.rope_scaling or {}
        return argparse.Namespace(
            num_layers=self.num_layers, hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads, group_query_attention=True,
            num_query_groups=self.num_query_groups, kv_channels=self.head_dim, normalization="RMSNorm",
            layernorm_epsilon=self.norm_epsilon, swiglu=True, add_bias_linear=False, add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            position_embedding_type="rope", rotary_base=self.rope_theta, rotary_percent=1.0,
            rotary_interleaved=False, use_rope_scaling=scaling.get("rope_type") == "llama3",
            rope_scaling_factor=float(scaling.get("factor", 8.0)),
            rotary_seq_len_interpolation_factor=(scaling["factor"] if scaling.get("rope_type") == "linear" else None),
            max_position_embeddings=self.max_position_embeddings,
            untie_embeddings_and_output_weights=not self.tied, vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size, mtp_num_layers=self.mtp_num_layers or None,
            mtp_use_repeated_layer=self.mtp_repeated, attention_dropout=self.attention_dropout, hidden_dropout=0.0,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, world_size=1, data_parallel_size=1, serving_extra=dict(self.extra),
            serving_family=self.family,
        )

    def trainer_flags(self, pad_to: int) -> list[str]:
        """The pretrain_gpt_mtp.py model flags that build exactly this model (its dropout too: Megatron's
        default of 0.1 would fine-tune another model than the one imported). `pad_to` is the
        --make-vocab-size-divisible-by that pads the vocabulary to `padded_vocab_size` at the
        tensor-parallel size the import was made for."""
        flags = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                 "--ffn-hidden-size", self.ffn_hidden_size, "--num-attention-heads", self.num_attention_heads,
                 "--group-query-attention", "--num-query-groups", self.num_query_groups,
                 "--kv-channels", self.head_dim, "--normalization", "RMSNorm", "--norm-epsilon", self.norm_epsilon,
                 "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
                 "--rotary-base", _number(self.rope_theta), "--max-position-embeddings", self.max_position_embeddings,
                 "--make-vocab-size-divisible-by", pad_to, "--attention-dropout", _number(self.attention_dropout),
                 "--hidden-dropout", "0"]
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if not self.tied:
            flags.append("--untie-embeddings-and-output-weights")
        if self.rope_scaling and self.rope_scaling["rope_type"] == "llama3":
            flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(self.rope_scaling["factor"])]
        elif self.rope_scaling:
            flags += ["--rotary-seq-len-interpolation-factor", _number(self.rope_scaling["factor"])]
        if self.mtp_num_layers:
            flags += ["--mtp-num-layers", self.mtp_num_layers]
            if self.mtp_repeated:
                flags.append("--mtp-use-repeated-layer")
        return [str(f) for f in flags]

    def as_dict(self) -> dict:
        return asdict(self)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        differing = {k: scaling.get(k) for k, v in LLAMA3_CONSTANTS.items() if float(scaling.get(k, -1)) != v}
        if differing:
            raise ServingError(f"config.json: llama3 rope_scaling with {differing} (megatron-core's Llama 3 "
                               f"scaling has {LLAMA3_CONSTANTS} built in)")
        return {"rope_type": "llama3", "factor": float(scaling["factor"]), **LLAMA3_CONSTANTS}
    raise ServingError(f"config.json: rope_scaling type {kind!r} is not supported (default, linear or llama3)")
