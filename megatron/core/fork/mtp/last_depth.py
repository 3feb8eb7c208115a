# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The last MTP depth's MLP at the rows its loss reads (with ``mtp_sparse_loss``).

Under the sparse loss h^D is read only where depth D is valid: no deeper depth consumes
it, and its other rows have loss weight 0 and take no part in any statistic. Attention
needs every position (keys and values), so the last depth's transformer layer runs its
attention as usual and then its MLP (pre-MLP norm, MLP, residual) at those rows only; the
other rows keep the attention output, which nothing reads. Depths 1..D-1 feed the next
depth's attention at every position and stay dense. On the benchmark's shape this takes
the MLP's 8h^2 of the layer's ~14h^2 per-token work out of the masked positions.

GPTModel's postprocess knows the rows (from labels and loss mask, see
megatron.core.fork.mtp.loss_branch) before the MTP block runs; ``taking_rows`` holds them while
the block runs its D layers in depth order, and the D-th layer call takes them
(repeated-layer mode runs one layer D times: the count is of calls, not of layers). The same
count says which depth is running (``current_depth``), for the per-depth router metrics.

An MoE MLP routes every row: its router losses and the expert bias's token counts are
defined over every token (spec section 11), and its shared experts run at every row. Only
the routed experts' work is taken to the rows: after the router, ``routed_rows`` hands the
dispatcher the taken rows (hidden states, probabilities, routing), and
``routed_output_at_every_row`` puts the combined output back, 0 at the other rows, which
nothing reads. Tokens dropped for capacity are chosen by the router over every row, but
with a capacity factor, MoE recompute (whose backward reruns the layer outside this
context), or a dispatcher that gathers equal shares from its ranks (allgather with EP or
expert TP, flex) the layer runs at every row.

HybridModel's MTP depth is a stack of hybrid layers: it is counted as a depth (for the
per-depth router metrics) and runs at every row.

Where the rows cannot be taken this way the layer runs at every row, as before:
sequence parallelism (the MLP exchanges equal sequence shards between ranks), full
activation recompute (its backward reruns the layer outside this context), fp8/fp4
(GEMM row alignment) and CUDA graphs (fixed shapes).
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class _PendingRows:
    rows: Optional[torch.Tensor]  # flat [s, b]-order positions valid at depth D; None: all
    layer_calls: int = 0


_pending: Optional[_PendingRows] = None


@dataclass
class _RoutedRows:
    rows: torch.Tensor
    shape: Optional[torch.Size] = None  # the MoE layer's input shape, once routed
_routed: Optional["_RoutedRows"] = None  # while the last depth's MoE layer runs


def rows_can_be_taken(config) -> bool:
    """Whether the last depth's layer can run its MLP at chosen rows (below); the sparse loss
    decides whether it reads only some (forward_settings.ForwardSettings.sparse)."""
    return (
        not config.sequence_parallel
        and config.recompute_granularity != "full"
        and not (config.fp8 or config.fp4)
        and config.cuda_graph_impl == "none"  # also set by the deprecated enable_cuda_graph
    )


@contextlib.contextmanager
def taking_rows(rows: Optional[torch.Tensor]):
    """Around the MTP block's forward: the D-th layer call runs its MLP at ``rows`` (flat
    [s, b]-order positions; None: at every row)."""
    global _pending
    outer = _pending
    _pending = _PendingRows(rows)
    try:
        yield
    finally:
        _pending = outer


def current_depth() -> Optional[int]:
    """The MTP depth (1..D) whose layer is running, inside the MTP block's forward; else None."""
    return _pending.layer_calls if _pending is not None and _pending.layer_calls else None


def transformer_layer(layer):
    """What the MTP layer calls in place of its transformer layer at this depth."""
    pending = _pending
    if pending is None:
        return layer
    pending.layer_calls += 1
    if pending.layer_calls != layer.config.mtp_num_layers or pending.rows is None:
        return layer
    if not hasattr(layer, "_forward_mlp"):  # HybridModel's depth: a stack of layers, run at every row
        return layer
    if layer.is_moe_layer:
        return functools.partial(_experts_at_rows, layer, pending.rows) if _experts_take_rows(layer) else layer
    return functools.partial(_mlp_at_rows, layer, pending.rows)


def _experts_take_rows(layer) -> bool:
    config = layer.config
    dispatcher = config.moe_token_dispatcher_type
    gathers_equal_shares = dispatcher == "allgather" and (
        config.expert_model_parallel_size * (config.expert_tensor_parallel_size or 1) > 1)
    return (config.moe_expert_capacity_factor is None and not getattr(config, "moe_latent_size", None)
            and not getattr(layer.mlp, "moe_layer_recompute", False)
            and dispatcher in ("alltoall", "allgather") and not gathers_equal_shares)


def routed_rows(hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """What an MoE layer dispatches to its routed experts (called after its router): inside
    the last depth's layer the rows its loss reads (hidden states as [rows, 1, h]);
    elsewhere everything."""
    rows = None if _routed is None else _routed.rows
    if rows is None or rows.numel() == routing_map.size(0):  # every row read: nothing to take
        return hidden_states, probs, routing_map
    _routed.shape = hidden_states.shape
    taken = hidden_states.reshape(-1, hidden_states.size(-1)).index_select(0, rows).unsqueeze(1)
    return taken, probs.index_select(0, rows), routing_map.index_select(0, rows)


def routed_output_at_every_row(output: torch.Tensor) -> torch.Tensor:
    """The routed experts' combined output at every row of the layer's input (0 at the rows
    ``routed_rows`` left out, which nothing reads); elsewhere unchanged."""
    if _routed is None or _routed.shape is None:
        return output
    every_row = output.new_zeros(_routed.shape.numel() // output.size(-1), output.size(-1))
    return every_row.index_copy(0, _routed.rows, output.reshape(-1, output.size(-1))).view(_routed.shape)


def _experts_at_rows(layer, rows, **layer_kwargs):
    global _routed
    outer, _routed = _routed, _RoutedRows(rows)
    try:
        return layer(**layer_kwargs)
    finally:
        _routed = outer


def _mlp_at_rows(layer, rows, **layer_kwargs):
    hidden, context = layer._forward_attention(**layer_kwargs)
    every_row = hidden.reshape(-1, hidden.size(-1))
    with _dropout_on_its_own_generator(layer, hidden.device):
        at_rows = layer._forward_mlp(every_row.index_select(0, rows).unsqueeze(1))
    # Out of place: autograd routes the gradient of the taken rows through the MLP and
    # that of the others (zero: nothing reads them) to the attention output.
    return every_row.index_copy(0, rows, at_rows.squeeze(1)).view_as(hidden), context


@contextlib.contextmanager
def _dropout_on_its_own_generator(layer, device):
    """The MLP's dropout over a data-dependent number of rows would advance the device's
    generator by a data-dependent amount, so data-parallel ranks would leave the step with
    different generator states; Megatron's checkpoint keeps one of them for all ranks, and
    a resumed run would then differ. Here the dropout draws from a generator seeded by one
    fixed-size draw of the device's own, which is restored afterwards: every rank's
    generator advances alike, whatever its rows."""
    if not (layer.training and layer.hidden_dropout > 0):
        yield
        return
    generator = torch.cuda.default_generators[device.index] if device.type == "cuda" else torch.default_generator
    seed = int(torch.randint(2**62, (1,), generator=generator, device=device))
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)
