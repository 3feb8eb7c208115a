# A tiny DeepSeek-V3-shaped mixture of experts with MTP (runs on CPU): the first layer dense,
# the others MoE with 8 routed experts (top-4 of 4 groups, at most 2 groups per token: DeepSeek-V3's
# ratio, 2 experts per chosen group, which its Hugging Face form assumes) and one
# shared expert; sigmoid router scores with the auxiliary-loss-free expert bias, plus the
# sequence-wise balance loss (seq_aux_loss) at a small weight; one MTP depth whose layer is an
# MoE layer like the backbone's last (DeepSeek-V3's layer 61). RMSNorm, SwiGLU, no linear biases.
# Every router loss here is exact in the step (docs/moe.md). Its attention is the command's, not
# DeepSeek-V3's multi-latent attention (deepseek_v3_tiny.sh adds it), and transformers' DeepSeek-V3
# has MLA only: the run exports as GLM-4.5 (Glm4MoeForCausalLM), DeepSeek-V3's MoE and MTP with
# multi-head or grouped-query attention.
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
          --normalization RMSNorm --swiglu --disable-bias-linear
          --num-experts 8 --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64
          --moe-layer-freq "[0,1,1,1]" --moe-router-topk 4
          --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5
          --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
          --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
          --moe-token-dispatcher-type alltoall)
