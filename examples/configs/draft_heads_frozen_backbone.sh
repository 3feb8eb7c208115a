# Speculative-decoding draft heads trained beside a backbone that another objective owns:
# isolation on (the heads' loss never reaches the backbone, the shared embedding or the
# output weight), the backbone frozen, and a pretrained backbone checkpoint (BACKBONE, with
# or without MTP heads) loaded with --finetune. Its checkpoint has no MTP tensors when it was
# trained without MTP: --dist-ckpt-strictness log_all lists them and keeps the heads'
# initialization instead of refusing the load.
MTP_ARGS=(--mtp-num-layers 2 --mtp-detach-heads --freeze-backbone --mtp-loss-scaling-factor 1.0)
if [[ -n "${BACKBONE:-}" ]]; then
    MTP_ARGS+=(--load "$BACKBONE" --finetune --dist-ckpt-strictness log_all)
fi
