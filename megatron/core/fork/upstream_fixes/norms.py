# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""megatron-core's torch norms (``WrappedTorchNorm``) with sequence parallelism and zero-centred
gamma, which Transformer Engine's and Apex's norms have and it asserted away. Its local specs and
blocks use it where neither is installed.

Sequence parallelism (the series' patch "Sequence parallelism with the torch norms"): each
tensor-parallel rank normalizes its own tokens, so a norm weight's gradient on one rank is a
partial sum; ``tagged_for_sequence_parallel`` tags the parameters as apex's and TE's are, and
``finalize_model_grads`` all-reduces them over TP.

Zero-centred gamma (``--apply-layernorm-1p``, the patch "Zero-centred gamma with the torch
norms"): the norm stores w and scales the normalized input by (1 + w), w started at zero
(Megatron-LM's LayerNorm-1p; Qwen3-Next's and Gemma's RMSNorm). ``zero_centered_class`` gives
torch's norm of that form: the same parameter names and shapes, the weight the zero-centred w
that Transformer Engine's checkpoints hold, so checkpoints interoperate. In bf16, 1 + w is
rounded to bf16 before it scales, as Apex's norms do (Transformer Engine adds the one in float32).

Both patches' hunks rebind ``WrappedTorchNorm``'s norm class before upstream's call builds it,
touching none of upstream's lines there (which upstream rewrites: Megatron-LM main names the
result and sets ``returns_residual`` on it).
"""

from typing import Callable

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


def zero_centered_class(norm_cls: type, config) -> type:
    """`norm_cls` (torch's LayerNorm or RMSNorm), or with ``layernorm_zero_centered_gamma`` its
    zero-centred form."""
    return ZERO_CENTERED[norm_cls] if config.layernorm_zero_centered_gamma else norm_cls


def tagged_for_sequence_parallel(build: Callable[..., torch.nn.Module], config) -> Callable[..., torch.nn.Module]:
    """`build` (a norm class), whose norms' parameters carry ``sequence_parallel`` from `config`."""

    def tagged(*args, **kwargs) -> torch.nn.Module:
        norm = build(*args, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm

    return tagged
