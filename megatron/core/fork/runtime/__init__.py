# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Part "runtime": what makes upstream run here (CPU and gloo, Python 3.11, without Transformer
Engine or flash-linear-attention). Called by the runtime patches; where CUDA is available
nothing they call changes what upstream does.

- device: the compute device, and the CUDA calls that become no-ops or CPU calls without it.
- collectives: gloo stand-ins for collectives NCCL has and gloo lacks.
- compat: which megatron-core release this is, and what it carries.
- context_parallel: context parallelism's layout, data split, MTP roll and key/value gather.
- sdpa_attention: core attention through torch's scaled_dot_product_attention (CP included).
- gated_delta_rule: the Gated DeltaNet kernels in torch (packed rows included).
- specs: the layer specs with the torch modules in place of Transformer Engine's.
"""
