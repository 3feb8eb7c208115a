# A tiny Qwen3-Next (runs on CPU) in its GPTModel form, the one that exports to Hugging Face
# (Qwen3NextForCausalLM; qwen3_next_tiny.sh is the HybridModel form, which export refuses): every
# fourth layer gated full attention with q/k RMSNorms (an output gate per head, RoPE on a quarter
# of each head), the others Gated DeltaNet; every layer's MLP an MoE with a gated shared expert;
# one MTP depth of full attention + MoE, as Qwen3-Next's. Zero-centred (1 + w) RMSNorms with
# Qwen3-Next's epsilon, SwiGLU. Use with --num-layers a multiple of 4.
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
          --experimental-attention-variant gated_delta_net --linear-attention-freq 4 --qk-layernorm
          --normalization RMSNorm --apply-layernorm-1p --norm-epsilon 1e-6 --swiglu --disable-bias-linear
          --attention-output-gate --rotary-percent 0.25
          --linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 32
          --linear-value-head-dim 32 --linear-conv-kernel-dim 4
          --num-experts 8 --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64
          --moe-shared-expert-gate --moe-router-topk 2 --moe-aux-loss-coeff 1e-3
          --moe-token-dispatcher-type alltoall)
