"""Each MTP depth's router losses as step values (spec section 11).

Upstream's MoE metrics tracker keeps one slot per layer: a repeated MTP layer runs at every
depth in one slot, and the console reports the mean over all MoE layers, backbone and MTP
together. The spec asks for ``mtp_k load balancing loss`` and ``mtp_k z loss`` besides
the backbone's as upstream reports them. The router hands each MTP depth's value (the one
upstream logs, with the same reduction groups) to ``record``; the depth is the MTP block's
current layer call (megatron.core.fork.mtp.last_depth counts them), so distinct and
repeated layers report alike. ``step_values`` reduces them once per step with upstream's
own tracker logic (sums over the reduce group, means over the average and data-parallel
groups) and divides by the step's micro-batches: with micro-batches of equal size, which
a step's are, that is the token-weighted step value of each loss.
"""

import torch

from megatron.core.fork import device as compute_device
from megatron.core.fork import router_losses
from megatron.core.fork.mtp import last_depth

LABELS = {"load_balancing_loss": "load balancing loss", "seq_load_balancing_loss": "seq load balancing loss",
          "global_load_balancing_loss": "global load balancing loss", "z_loss": "z loss"}
_BALANCE_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
_TRACKER = None  # upstream's MoEMetricsTracker (megatron-core 0.19+), made at the first record


def _tracker():
    global _TRACKER
    if _TRACKER is None:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

        _TRACKER = MoEMetricsTracker()
    return _TRACKER


def record(router, name: str, value: torch.Tensor, **reduction) -> None:
    """One MTP depth's router loss of one micro-batch (ignored outside the MTP block)."""
    if not router.is_mtp_layer:
        return
    depth = last_depth.current_depth()
    if depth is not None:
        _tracker().record(name, value, depth, router.config.mtp_num_layers, **reduction)


def reset() -> None:
    """Start a step: nothing recorded (and no slots sized for another model's depths)."""
    global _TRACKER
    _TRACKER = None


def _names(config) -> list:
    kinds = router_losses.load_balancing_types(config)
    coeffs = router_losses.coefficients(config)
    names = [_BALANCE_NAMES[kind] for kind, coeff in zip(kinds, coeffs, strict=True)
             if coeff and coeff > 0 and kind in _BALANCE_NAMES]
    return names + (["z_loss"] if config.moe_z_loss_coeff else [])


def step_values(config, num_microbatches: int) -> dict:
    """{"mtp_k <loss>": value} of the step's micro-batches since ``reset``, the same on every
    rank (collectives: every rank calls it); {} without MTP router losses."""
    depths = config.mtp_num_layers or 0
    if not depths or not router_losses.active(config):
        return {}
    names, tracker = _names(config), _tracker()
    for name in names:  # ranks without an MTP layer join the reduction with zeros
        tracker.ensure_initialized(name, depths, device=compute_device.current_device())
    tracker._sync_metrics(names)
    values = {}
    for name in names:
        per_depth = tracker.metrics[name].values.double().cpu() / max(num_microbatches, 1)
        values.update({f"mtp_{k + 1} {LABELS[name]}": float(v) for k, v in enumerate(per_depth)})
    reset()
    return values
