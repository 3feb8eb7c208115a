# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Each MTP depth's router losses as step values (spec section 11).

Upstream's MoE metrics tracker keeps one slot per layer: a repeated MTP layer runs at every
depth in one slot, and the console reports the mean over all MoE layers, backbone and MTP
together. The spec asks for ``mtp_k load balancing loss`` and ``mtp_k z loss`` besides
the backbone's as upstream reports them. The router hands each MTP depth's value (the one
upstream logs) to ``record`` with its reduction groups; the depth is the MTP block's
current layer call (megatron.core.fork.mtp.last_depth counts them; outside the MTP block
there is none, so backbone routers record nothing), so distinct and repeated layers report
alike. ``RouterMetrics.step_values`` reduces them once per step as megatron-core 0.19's MoEMetricsTracker
reduces its metrics (a sum over the pipeline stages, a sum over the reduce group (balance
losses: the router's TP-CP group), a mean over the average group (z-loss: TP-DP-CP), then
a mean over the data-parallel ranks unless the reduce group already spans them) and
divides by the step's micro-batches: with micro-batches of equal size, which a step's are,
that is the token-weighted step value of each loss. The accumulator is the fork's own, so
0.16.1 (whose tracker is a dict of per-layer slots, reduced differently) and 0.19 report
the same values; it is the running step's (``RouterMetrics``), which the router finds bound to
itself (megatron.core.fork.mtp.forward_settings): a router of another model records nothing there.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron.core.fork.mtp import last_depth, router_losses
from megatron.core.fork.mtp.forward_settings import step_of
from megatron.core.fork.runtime import device as compute_device

LABELS = {"load_balancing_loss": "load balancing loss", "seq_load_balancing_loss": "seq load balancing loss",
          "global_load_balancing_loss": "global load balancing loss", "z_loss": "z loss"}
_BALANCE_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


@dataclass
class _Entry:
    values: torch.Tensor  # [D]: the step's sum over micro-batches, per depth
    reduce_group: Optional[torch.distributed.ProcessGroup] = None
    avg_group: Optional[torch.distributed.ProcessGroup] = None
    needs_dp_avg: bool = True


def record(router, name: str, value: torch.Tensor, reduce_group=None, avg_group=None,
           needs_dp_avg: bool = True) -> None:
    """One MTP depth's router loss of one micro-batch, into the router's running step's metrics
    (ignored outside the MTP block, and for a router no step is bound to)."""
    step, depth = step_of(router), last_depth.current_depth()
    if step is not None and depth is not None:
        step.router_metrics.add(router.config.mtp_num_layers, depth, name, value, reduce_group, avg_group,
                                needs_dp_avg)


def names(config) -> list:
    """The router losses the config's routers record (megatron-core's tracker names)."""
    kinds = router_losses.load_balancing_types(config)
    coeffs = router_losses.coefficients(config)
    balance = [_BALANCE_NAMES[kind] for kind, coeff in zip(kinds, coeffs, strict=True)
               if coeff and coeff > 0 and kind in _BALANCE_NAMES]
    return balance + (["z_loss"] if config.moe_z_loss_coeff else [])


class RouterMetrics:
    """One step's MTP-depth router losses, name -> per-depth sums over its micro-batches."""

    def __init__(self):
        self.entries: dict = {}

    def add(self, depths: int, depth: int, name: str, value: torch.Tensor, reduce_group, avg_group,
            needs_dp_avg: bool) -> None:
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(torch.zeros(depths, device=value.device))
        entry.values[depth - 1] += value.detach()
        entry.reduce_group, entry.avg_group, entry.needs_dp_avg = reduce_group, avg_group, needs_dp_avg

    def _reduce(self, names: list) -> None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
        for name in names:
            entry = self.entries[name]
            torch.distributed.all_reduce(entry.values, group=pp_group)
            if entry.reduce_group is not None:
                torch.distributed.all_reduce(entry.values, group=entry.reduce_group)
            if entry.avg_group is not None:
                torch.distributed.all_reduce(entry.values, group=entry.avg_group, op=torch.distributed.ReduceOp.AVG)
            if entry.needs_dp_avg:
                torch.distributed.all_reduce(entry.values, group=dp_group, op=torch.distributed.ReduceOp.AVG)

    def step_values(self, config, num_microbatches: int) -> dict:
        """{"mtp_k <loss>": value} of the step's micro-batches, the same on every rank (collectives:
        every rank calls it), consumed; {} without MTP router losses."""
        depths = config.mtp_num_layers or 0
        if not depths or not router_losses.active(config):
            return {}
        recorded = names(config)
        for name in recorded:  # ranks without an MTP layer join the reduction with zeros
            if name not in self.entries:
                self.entries[name] = _Entry(torch.zeros(depths, device=compute_device.current_device()))
        self._reduce(recorded)
        values = {}
        for name in recorded:
            per_depth = self.entries[name].values.double().cpu() / max(num_microbatches, 1)
            values.update({f"mtp_{k + 1} {LABELS[name]}": float(v) for k, v in enumerate(per_depth)})
        self.entries.clear()
        return values
