# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Zero-centred gamma (``--apply-layernorm-1p``) for megatron-core's torch norms.

A zero-centred norm stores w and scales the normalized input by (1 + w), w started at zero
(Megatron-LM's LayerNorm-1p; Qwen3-Next's and Gemma's RMSNorm). Transformer Engine's and Apex's
norms have it (``layernorm_zero_centered_gamma``); megatron-core's ``WrappedTorchNorm``, which
its local specs and blocks use where neither is installed, asserted it away. The series' patch
"Zero-centred gamma with the torch norms" has it build torch's norm and hand it to
``zero_centered``: the same module (parameter names, sequence-parallel marks), whose weight is
the zero-centred w that Transformer Engine's checkpoints hold, so checkpoints interoperate.

In bf16, 1 + w is rounded to bf16 before it scales, as Apex's norms do (Transformer Engine adds
the one in float32).
"""

import torch
import torch.nn.functional as F


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    def reset_parameters(self) -> None:  # (also what meta-device initialization calls)
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


ZERO_CENTERED = {torch.nn.LayerNorm: ZeroCenteredLayerNorm, torch.nn.RMSNorm: ZeroCenteredRMSNorm}


def zero_centered(norm: torch.nn.Module) -> torch.nn.Module:
    """`norm` (torch's LayerNorm or RMSNorm with a weight, just built) scaling by (1 + weight),
    its weight zero."""
    if norm.weight is None:
        raise ValueError("zero-centred gamma needs the norm's weight (elementwise_affine)")
    norm.__class__ = ZERO_CENTERED[type(norm)]
    with torch.no_grad():
        norm.reset_parameters()
    return norm
