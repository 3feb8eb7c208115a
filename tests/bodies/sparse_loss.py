# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The sparse, chunked MTP loss (mtp_sparse_loss) on the masks that stress it, against the
plain-PyTorch reference, and under TP = 2 with vocabulary-parallel argmax ties."""

import dataclasses
import itertools

import torch
from megatron.core import parallel_state
from megatron.core.transformer import multi_token_prediction

from megatron.core.fork.mtp.statistics import STEP_STATISTICS
from megatron_mtp.library.model import build_gpt
from tests.bodies.mtp_model import (
    SEQ,
    VOCAB,
    Capture,
    against_reference,
    counts_equal,
    make_config,
    max_rel,
    reference_for,
    reference_sums,
    run_megatron,
)
from tests.harness.layout import model_parallel

DEPTHS = 3


def masks() -> dict:
    """Loss masks [4, SEQ] over label positions; depth k's mask is the mask rolled by k.

    full: every depth valid wherever it has a target. depth3_empty: labels valid only at
    positions < 3, so depth 3 has no valid position in the whole micro-batch while depths 1
    and 2 have a few. mixed: one row of each kind, a row with holes, an all-zero row.
    empty: nothing valid at any depth (the MTP branch gets zero rows).
    """
    g = torch.Generator().manual_seed(5)
    holes = (torch.rand(4, SEQ, generator=g) > 0.4).float()
    early = torch.zeros(4, SEQ)
    early[:, :3] = 1.0
    mixed = torch.stack([torch.ones(SEQ), early[0], holes[0], torch.zeros(SEQ)])
    return {"full": torch.ones(4, SEQ), "depth3_empty": early, "mixed": mixed, "holes": holes,
            "empty": torch.zeros(4, SEQ)}


class MlpRows:
    """Records how many rows each MTP layer's MLP call receives, in call (depth) order."""

    def __init__(self, model):
        self.modules = [m for name, m in model.mtp.named_modules() if name.endswith(".mlp")]
        self.rows = []

    def __enter__(self):
        self.hooks = [m.register_forward_hook(lambda module, args, out: self.rows.append(args[0].shape[:-1].numel()))
                      for m in self.modules]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def mask_extremes() -> dict:
    """Each mask x chunk size (1; 7, which divides no row count here; larger than all rows)
    against the reference and the dense path on the same weights."""
    out = {}
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, VOCAB, (4, SEQ + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    with model_parallel():
        torch.manual_seed(17)
        model = build_gpt(make_config(DEPTHS), VOCAB, SEQ)
        ref = reference_for(model, DEPTHS, False, False, False)
        for name, mask in masks().items():
            logits, _, per_depth = ref.losses(input_ids, labels, mask)
            ref.zero_grad(set_to_none=True)
            ref.objective_sums(input_ids, labels, mask).backward()
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
            ref_sums = reference_sums(logits, per_depth)
            # Rows the sparse branch computes: valid at a depth or at a deeper one.
            needed = torch.zeros_like(mask, dtype=torch.bool)
            rows = 0
            for _, mask_k, _, _ in reversed(per_depth):
                needed |= mask_k != 0
                rows += int(needed.sum())
            case = {"valid_per_depth": ref_sums[:, 1].tolist(), "rows": rows, "every_row": mask.numel()}
            for chunk in (1, 7, 1000, None):  # None: the dense path
                model.config.mtp_sparse_loss = chunk is not None
                model.config.sparse_loss_chunk_size = chunk or 1
                with MlpRows(model) as mlp:
                    got = run_megatron(model, input_ids, labels, mask, None)
                case[f"chunk{chunk}" if chunk else "dense"] = {
                    "mlp_rows": mlp.rows,
                    "grads": max(max_rel(got["grads"][n], ref_grads[n]) for n in ref_grads),
                    "grads_finite": all(bool(torch.isfinite(v).all()) for v in got["grads"].values()),
                    "same_grad_names": sorted(got["grads"]) == sorted(ref_grads),
                    "sums": max_rel(got["sums"], ref_sums),
                    "counts_exact": counts_equal(got["sums"], ref_sums),
                }
            out[name] = case
    return out


def last_depth_rows_by_mode() -> dict:
    """Rows each MTP MLP call receives (mask "holes"): in repeated-layer mode (one layer run D
    times) and where the layer stays dense (full recompute; the dense loss path)."""
    out = {}
    g = torch.Generator().manual_seed(13)
    tokens = torch.randint(1, VOCAB, (4, SEQ + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    mask = masks()["holes"]
    with model_parallel():
        for name, config in {"repeated": make_config(DEPTHS, repeated=True),
                             "recompute": make_config(DEPTHS, recompute=True),
                             "dense_loss": make_config(DEPTHS, mtp_sparse_loss=False)}.items():
            torch.manual_seed(17)
            model = build_gpt(config, VOCAB, SEQ)
            with MlpRows(model) as mlp:
                run_megatron(model, input_ids, labels, mask, None)
            out[name] = mlp.rows
    out["valid_at_last_depth"] = int(mask[:, DEPTHS:].sum())
    out["every_row"] = 4 * SEQ
    return out


def lm_loss_cases() -> dict:
    """sparse_lm_loss (chunks of 7) against the reference, for D = 0 and 2, tied and untied
    output weights, padded and packed rows: the main per-token loss where the mask keeps it
    (zero elsewhere) and every gradient, the loss summed times the mask as pretrain_gpt does."""
    out = {}
    with model_parallel():
        for depths, tied, layout in itertools.product((0, 2), (False, True), ("padded", "packed")):
            config = make_config(depths, sparse_lm_loss=True, sparse_loss_chunk_size=7)
            got, (_, main_ce, _), want, mask = against_reference(config, 41 + depths, tied, layout)
            out[f"D{depths}-{'tied' if tied else 'untied'}-{layout}"] = {
                "main_ce": max_rel(got["main_ce"] * mask, (main_ce * mask).detach()),
                "zero_where_masked": bool((got["main_ce"][mask == 0] == 0).all()),
                "grads": max(max_rel(got["grads"][n], want[n]) for n in want),
                "same_grad_names": sorted(got["grads"]) == sorted(want),
            }
    return out


def confident_chain() -> dict:
    """Every MTP depth predicts one token v everywhere (its final norm: weight 0, bias fixed)
    and every target is v, so each depth-k position is chain-correct: the chain count must
    equal the valid count, also where a shallower depth's own target is masked (there the
    sparse branch computes that depth's prediction without a loss)."""
    out = {}
    with model_parallel():
        torch.manual_seed(19)
        model = build_gpt(make_config(DEPTHS, sparse_loss_chunk_size=7), VOCAB, SEQ)
        with torch.no_grad():
            bias = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(23))
            for name, param in model.named_parameters():
                if name.startswith("mtp.") and "final_layernorm" in name:
                    param.copy_(bias if name.endswith("bias") else torch.zeros_like(param))
            token = int((bias @ model.output_layer.weight.t()).argmax())
        g = torch.Generator().manual_seed(37)
        input_ids = torch.randint(1, VOCAB, (4, SEQ), generator=g)
        labels = torch.full_like(input_ids, token)
        ref = reference_for(model, DEPTHS, False, False, False)
        for name in ("holes", "mixed"):
            mask = masks()[name]
            logits, _, per_depth = ref.losses(input_ids, labels, mask)
            got = run_megatron(model, input_ids, labels, mask, None)
            out[name] = {"sums": got["sums"].tolist(), "reference": reference_sums(logits, per_depth).tolist()}
    return out


def vocab_parallel_ties() -> dict:
    """TP = 2 (sparse MTP and LM losses against dense), vocabulary 48 in shards of 24, the second shard's
    output weight a copy of the
    first: every top logit is tied between v and v + 24, and argmax over the full vocabulary
    must pick v (as torch.argmax on gathered logits). Depth-1 targets are set to v at even
    valid positions and to v + 24 at odd ones, so the correct count is known by construction
    and a tie broken towards the higher index would swap it."""
    out = {}
    shard = VOCAB // 2
    with model_parallel(tp=2):
        torch.manual_seed(29)
        config = dataclasses.replace(make_config(2), tensor_model_parallel_size=2, sparse_loss_chunk_size=5)
        model = build_gpt(config, VOCAB, SEQ)
        g = torch.Generator().manual_seed(31)
        half = torch.randn(shard, model.config.hidden_size, generator=g) * 0.5
        with torch.no_grad():
            model.output_layer.weight.copy_(half)  # the same shard on both ranks
        tokens = torch.randint(1, VOCAB, (4, SEQ + 1), generator=g)
        input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        mask = (torch.rand(4, SEQ, generator=g) > 0.25).float()

        # Depth-1 predictions from this rank's shard (either shard: they are equal).
        model.config.mtp_sparse_loss = False
        with Capture(model) as capture:
            multi_token_prediction.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            positions = torch.arange(SEQ).unsqueeze(0).expand_as(input_ids)
            model(input_ids, positions, None, labels=labels, loss_mask=mask)
        lowest = capture.split()[1][0].argmax(dim=-1)  # depth 1's [b, s], indices < 24
        # Depth 1 at position t predicts labels[t + 1].
        parity = (torch.arange(SEQ - 1) % 2).expand(4, -1)
        labels[:, 1:] = lowest[:, :-1] + shard * parity
        mask_1 = mask[:, 1:]
        out["expected_correct_1"] = float((mask_1 * (parity == 0)).sum())
        out["tied_partner_targets_1"] = float((mask_1 * (parity == 1)).sum())

        for sparse in (True, False):  # both heads sparse, or both dense
            model.config.mtp_sparse_loss = model.config.sparse_lm_loss = sparse
            got = run_megatron(model, input_ids, labels, mask, None)
            out["sparse" if sparse else "dense"] = {"sums": got["sums"].tolist(), "grads": got["grads"]}
        sparse_grads, dense_grads = out["sparse"].pop("grads"), out["dense"].pop("grads")
        out["grads_sparse_vs_dense"] = max(max_rel(sparse_grads[n], dense_grads[n]) for n in dense_grads)
        out["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
    STEP_STATISTICS.reset()
    return out
