# Speculative-decoding draft heads trained beside a backbone that another objective owns:
# isolation on (the heads' loss never reaches the backbone, the shared embedding or the
# output weight), the backbone frozen, and a pretrained backbone checkpoint (BACKBONE, with
# or without MTP heads) loaded with --finetune. Heads the checkpoint lacks (it was trained
# with fewer depths, or without MTP) keep their initialization: the trainer loads with
# --dist-ckpt-strictness log_all then, which lists them.
MTP_ARGS=(--mtp-num-layers 2 --mtp-detach-heads --freeze-backbone --mtp-loss-scaling-factor 1.0)
if [[ -n "${BACKBONE:-}" ]]; then
    MTP_ARGS+=(--load "$BACKBONE" --finetune)
fi
