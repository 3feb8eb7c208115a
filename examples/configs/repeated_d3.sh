# Three depths sharing one MTP layer (mtp.layers.0.*, applied at every depth; its gradient is
# the sum of all depths' chain terms): a 4-token draft from one head's parameters.
MTP_ARGS=(--mtp-num-layers 3 --mtp-use-repeated-layer --mtp-loss-scaling-factor 0.3)
