# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A Megatron-LM pretrain_gpt.py-style entry script: a user's own, with the series applied.

Its loss function keeps upstream pretrain_gpt.py's contract (the raw masked CE sum, its
token count, and [sum, count] for the 'lm loss' report), it parses Megatron-LM's flags with
nothing of this project's trainer (no megatron_mtp.arguments checks, no exact_step.enable),
and it calls megatron.training.pretrain(). Only the model, data and batch come from
pretrain_gpt_mtp.py, so that both scripts train the same network on the same samples.
The series' --exact-steps flag is what makes its steps exact.
"""

import sys
from functools import partial

import torch

import pretrain_gpt_mtp as trainer


def loss_func(loss_mask, output_tensor):
    """Upstream pretrain_gpt.py's per-token loss contract."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting_loss}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model

    tokens, labels, loss_mask, position_ids = trainer.get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def main() -> int:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_mtp.arguments.defaults import CPU_DEFAULTS

    def cpu_defaults(parser):  # what a user passes on the command line to run on CPU
        parser.set_defaults(**CPU_DEFAULTS)
        return parser

    args = parse_and_validate_args(cpu_defaults)
    trainer.datasets_provider.is_distributed = True
    pretrain(pretrain_cfg_container_from_args(args), trainer.datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=trainer.model_provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
