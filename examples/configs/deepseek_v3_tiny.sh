# A tiny DeepSeek-V3 (runs on CPU): multi-latent attention (q-LoRA and kv-LoRA ranks, a shared
# RoPE key, RMSNorms inside both low-rank projections) over the MoE stack of
# deepseek_v3_moe_tiny.sh (first layer dense, routed experts with a shared one, sigmoid scores
# with the expert bias, the sequence-wise balance loss) and one MTP depth, whose layer is MLA +
# MoE like the backbone's last. Trains as exactly as a dense GPT (docs/architectures.md). The
# norms' epsilon is DeepSeek-V3's, 1e-6, which transformers' form of its low-rank norms fixes: the
# run exports as DeepSeek-V3 (tools/convert_checkpoint.py export, the default layout).
source "$(dirname "${BASH_SOURCE[0]}")/deepseek_v3_moe_tiny.sh"
MTP_ARGS+=(--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16
           --qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm --norm-epsilon 1e-6)
