# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""megatron-core with the series, used as a library: no megatron.training.

What a library user of either carried build needs around the series, and what the test
suite and benchmarks drive: bring up the parallel state (`initialize`), build DDP-wrapped
GPT chunks with MTP (`model`), cut a global batch into this rank's micro-batches
(`batches`), run one exact optimizer step on a SplitStep (`step`), save and load with
dist checkpointing atomically and shape-checked (`checkpointing`). megatron-core 0.16.1
ships no training loop, so this is how the 0.16.1 series is used; an RL or SFT controller
on either build drives the same SplitStep. `pretrain_gpt_mtp.py` runs on upstream's own
loop instead (megatron.training, 0.19.2).
"""
