# DeepSeek-V3-style MTP: one depth, attached (its loss also trains the backbone), weight 0.3
# (DeepSeek-V3 used 0.3 for the first 10T tokens, then 0.1). DeepSeek-V3's MTP recipe, not its
# architecture: the model is the command's. The quick start's GPT (LayerNorm, GELU, biases) is
# refused by the Hugging Face export, which names each of the three; with --normalization RMSNorm
# --swiglu --disable-bias-linear it exports as Llama, its depth in DeepSeek-V3's MTP layout.
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3)
