# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""From training to serving: Hugging Face import/export of the backbone and the MTP heads
(tools/convert_checkpoint.py) and speculative decoding with the heads as drafts
(tools/eval_speculative.py).

- config: the model description both sides share (the families it names, with MTP depths), read
  from a Hugging Face config.json or from a trainer checkpoint's arguments, written to both;
  trainer_args: its Megatron side (a checkpoint's arguments read, the arguments and trainer flags
  written).
- mapping: tensor names and layouts between megatron-core's global checkpoint tensors and
  Hugging Face's (fused QKV per query group, [gate; up], Gated DeltaNet's in_proj sections, MTP in
  MiMo's, DeepSeek-V3's or Qwen3-Next's layout), and a Qwen3.5 VLM checkpoint's language model.
- experts: a layer's routed experts one tensor per expert or stacked, and each family's
  published layout.
- export: a model's Hugging Face tensors as export writes them (its refusals, the mapping, the
  experts' layout, the dtype) and where an engine serves the MTP layout otherwise: one home for
  convert_checkpoint.py export and the weight stream.
- stream: the weight stream of a live distributed model (any TP / PP / VPP / EP layout) in
  Hugging Face names, bit for bit the export's: what an RL framework pushes to its rollout engine.
- files: reading and writing Hugging Face directories and megatron-core dist checkpoints.
- model: megatron-core's GPTModel or HybridModel in one process (any saved TP / PP / VPP layout is read
  through dist checkpointing), its main-head and per-depth MTP forward over a KV cache.
- kv_cache: the cache and the core attention that reads it (one stream per model part).
- speculative: greedy decoding with MTP drafts, verified by the main head, and its statistics.
- prompts: eval_speculative.py's prompts (a dataset's documents or a file) and the tokenizer
  that encodes them (the checkpoint's own by default).

Every refusal is a ServingError whose message is one line.
"""


class ServingError(ValueError):
    """Bad input for a conversion or an evaluation; the message is one line."""
