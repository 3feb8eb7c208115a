"""One optimizer step through megatron-core's schedules, and its globally reduced loss.

The loss function follows megatron-core's `calculate_per_token_loss` convention: it
returns the raw loss sum and the valid-token count of its micro-batch, and
finalize_model_grads divides every gradient once by the step's global token count.
"""

from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fork import device as compute_device
from megatron.core.fork.mtp.statistics import STEP_STATISTICS, metrics_from_sums
from megatron.core.pipeline_parallel import get_forward_backward_func


def masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    loss_sum = (per_token_loss.float().reshape(-1) * mask).sum()
    count = mask.sum().to(torch.int)
    return loss_sum, count, {"lm loss": torch.stack([loss_sum.detach(), count.detach().float()])}


def gpt_forward_step(data_iterator, model):
    """Micro-batch = (tokens [b, s+1], loss_mask [b, s]); targets are tokens shifted by one."""
    tokens, loss_mask = next(data_iterator)
    device = compute_device.current_device()
    tokens, loss_mask = tokens.to(device), loss_mask.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.size(1), device=device).unsqueeze(0).expand_as(inputs)
    output = model(inputs, positions, None, labels=labels, loss_mask=loss_mask)
    return output, partial(masked_token_loss, loss_mask)


def train_step(chunks, optimizer, microbatches: list, seq_length: int, forward_step=gpt_forward_step) -> dict:
    """Forward/backward over this rank's micro-batches, then one optimizer step.

    Returns the step's token-weighted loss over all data-parallel ranks (the same on every
    rank), the gradient norm of each group ("grad_norm" is the main group's), whether the
    optimizer skipped the step, and the exact per-depth MTP metrics and their sums.
    """
    STEP_STATISTICS.reset()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0][0].size(0),
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    totals = torch.zeros(2, device=compute_device.current_device())
    for entry in losses:  # only the last pipeline stage has entries
        totals += entry["lm loss"]
    loss_sum, tokens = last_stage_sum(totals).tolist()
    result = {
        "loss": loss_sum / tokens if tokens else 0.0,
        "tokens": int(tokens),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "grad_norms": {name: float(norm) for name, norm in getattr(optimizer, "grad_norms_by_group", {}).items()},
        "skipped": not update_successful,
    }
    mtp_depths = chunks[0].config.mtp_num_layers
    if mtp_depths:
        local = STEP_STATISTICS.reduced()
        if local is None:
            local = torch.zeros(mtp_depths, 4, dtype=torch.float64, device=compute_device.current_device())
        sums = last_stage_sum(local)
        result["mtp_sums"] = sums.tolist()
        result.update(metrics_from_sums(sums))
    return result


def last_stage_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum over data-parallel ranks of what the last pipeline stage holds, on every rank."""
    total = local.clone()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    else:
        total.zero_()
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total
