"""Data for pretrain_gpt_mtp.py: tokenizers from local files, megatron-core indexed datasets
with a metadata file, and the embedded default corpus."""
