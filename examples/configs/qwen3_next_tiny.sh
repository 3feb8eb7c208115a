# A tiny Qwen3-Next (runs on CPU) as a HybridModel: three Gated DeltaNet layers and one gated
# full-attention layer (an output gate per head, RoPE on a quarter of each head), each followed
# by an MoE layer with a shared expert; one MTP depth of full attention + MoE, as Qwen3-Next's.
# Zero-centred (1 + w) RMSNorms and SwiGLU (the DeltaNet's convolution and output gate use SiLU).
# Left out because upstream's hybrid attention layer has none, and refused in one line rather than
# dropped: q/k RMSNorms. Qwen3-Next's GPTModel form has them: --experimental-attention-variant
# gated_delta_net --linear-attention-freq 4 --qk-layernorm in place of the pattern
# (docs/architectures.md); qwen3_next_gpt_tiny.sh is that form, which exports to Hugging Face
# (this HybridModel form does not).
MTP_ARGS=(--hybrid-layer-pattern "GEGEGE*E/*E" --mtp-loss-scaling-factor 0.3
          --normalization RMSNorm --apply-layernorm-1p --swiglu --disable-bias-linear
          --attention-output-gate --rotary-percent 0.25
          --linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 32
          --linear-value-head-dim 32 --linear-conv-kernel-dim 4
          --num-experts 8 --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64
          --moe-router-topk 2 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall)
