# DeepSeek-V3-style MTP: one depth, attached (its loss also trains the backbone), weight 0.3
# (DeepSeek-V3 used 0.3 for the first 10T tokens, then 0.1).
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3)
