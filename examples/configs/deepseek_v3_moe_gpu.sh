# A DeepSeek-V3-shaped mixture of experts with MTP for the GPU scripts (gpu_single_node.sh,
# gpu_multi_node.sh, slurm/): the first layer dense, every other layer MoE with 64 routed
# experts (top-8 of 8 groups, at most 4 groups per token: DeepSeek-V3's routing, which
# transformers' DeepSeek-V3 and GLM-4.5 classes compute) and one shared expert; sigmoid
# router scores with the auxiliary-loss-free expert bias, plus the sequence-wise balance loss
# (seq_aux_loss) at a small weight; one MTP depth whose layer is an MoE layer like the
# backbone's last (DeepSeek-V3's layer 61). Experts run as Transformer Engine grouped GEMMs
# and are spread over EP GPUs (default 8: one node) with the alltoall token dispatcher; EP
# divides the data-parallel size. Every router loss here is exact in the step
# (docs/moe.md). gpu_args.sh's model is otherwise unchanged (24 layers, hidden 2048,
# RMSNorm, SwiGLU, no linear biases).
#
#   CONFIG=examples/configs/deepseek_v3_moe_gpu.sh EP=8 DATA=... bash examples/gpu_single_node.sh
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
          --num-experts 64 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 1408
          --moe-layer-freq "([0]*1+[1]*23)" --moe-router-topk 8
          --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5
          --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
          --moe-router-dtype fp32
          --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
          --moe-grouped-gemm --moe-token-dispatcher-type alltoall
          --expert-model-parallel-size "${EP:-8}")
