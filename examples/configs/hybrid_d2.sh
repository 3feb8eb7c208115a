# HybridModel (megatron-core 0.19's successor of GPTModel) with two MTP depths, all in one
# pattern: four attention + MLP layer pairs, then "/*-" per depth (one attention and one MLP
# layer each). The pattern sets the layer count and --mtp-num-layers; it is part of the
# checkpoint's shape. Trained as exactly as a GPTModel (docs/hybrid.md).
MTP_ARGS=(--hybrid-layer-pattern "*-*-*-*-/*-/*-" --mtp-loss-scaling-factor 0.3)
