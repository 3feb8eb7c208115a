# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The chunked cross-entropy Function of the sparse losses on its own (one process, no TP):
against torch's cross-entropy with autograd, for every chunking, row weights with fractional
values and zeros, a logit scale, the check of the loss's weighting, and the fused main_grad
protocol of upstream's output layer."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.mtp.sparse_cross_entropy import ChunkedVocabParallelCrossEntropy
from megatron.core.fork.mtp.sparse_loss import rows_needed

ROWS, HIDDEN, VOCAB = 23, 16, 40


def inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(ROWS, HIDDEN, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    row_weights = torch.rand(ROWS, generator=g, dtype=dtype)
    row_weights[::4] = 0.0  # chain-only rows
    return rows, weight, labels, row_weights


def sparse(rows, weight, labels, row_weights, chunk=5, scale=1.0, fuse=False):
    return ChunkedVocabParallelCrossEntropy.apply(rows, weight, labels, row_weights, chunk, None, scale,
                                                  torch.is_grad_enabled(), fuse)[:2]


def reference(rows, weight, labels, scale=1.0):
    logits = rows @ weight.t() * scale
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(dim=-1)


@pytest.mark.parametrize("chunk", [1, 5, 23, 100])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_ce_argmax_and_gradients_equal_autograd(chunk, scale):
    rows, weight, labels, row_weights = inputs()
    want_ce, want_argmax = reference(rows, weight, labels, scale)
    want_rows, want_weight = torch.autograd.grad((want_ce * row_weights).sum() * 2.5, (rows, weight))
    ce, argmax = sparse(rows, weight, labels, row_weights, chunk, scale)
    got_rows, got_weight = torch.autograd.grad((ce * row_weights).sum() * 2.5, (rows, weight))
    # float64 throughout: agreement to 1e-12 relative (measured ~1e-16).
    for got, want in ((ce, want_ce), (got_rows, want_rows), (got_weight, want_weight)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(argmax, want_argmax)


def test_a_loss_weighted_otherwise_than_promised_is_refused():
    rows, weight, labels, row_weights = inputs()
    ce, _ = sparse(rows, weight, labels, row_weights)
    with pytest.raises(RuntimeError, match="not proportional to their weights"):
        ce.sum().backward()  # weights 1 everywhere, not row_weights


def test_detached_weight_gets_no_gradient_and_any_row_weighting_is_exact():
    rows, weight, labels, row_weights = inputs()
    ce, _ = sparse(rows, weight.detach(), labels, row_weights)
    ce.sum().backward()  # row gradients do not depend on the promised weighting
    want, = torch.autograd.grad(reference(rows, weight.detach(), labels)[0].sum(), (rows,))
    assert weight.grad is None and torch.allclose(rows.grad, want, rtol=1e-12, atol=1e-12)


def test_fused_weight_gradient_goes_to_main_grad_like_upstreams_output_layer():
    """With gradient_accumulation_fusion upstream's output layer adds its weight gradient to
    main_grad and sets grad_added_to_main_grad, after which DDP ignores param.grad."""
    rows, weight, labels, row_weights = inputs(torch.float32)
    param = torch.nn.Parameter(weight.detach().clone())
    param.main_grad = torch.full_like(param, 0.5)
    param.grad_added_to_main_grad = False
    ce, _ = sparse(rows, param, labels, row_weights, fuse=True)
    (ce * row_weights).sum().backward()
    _, want = torch.autograd.grad((reference(rows, weight, labels)[0] * row_weights).sum(), (rows, weight))
    assert param.grad is None and param.grad_added_to_main_grad is True
    assert torch.allclose(param.main_grad, want + 0.5, rtol=1e-5, atol=1e-6)


def test_no_gradient_work_without_grad_mode():
    rows, weight, labels, row_weights = inputs()
    with torch.no_grad():
        ce, _ = sparse(rows, weight, labels, row_weights)
    assert ce.grad_fn is None and torch.allclose(ce, reference(rows, weight, labels)[0])


def test_rows_needed_covers_deeper_depths():
    # depth 1 valid at t = 0, depth 2 at t = 1, depth 3 nowhere (b = 1, s = 4).
    masks = [torch.tensor([[1.0, 0, 0, 0]]), torch.tensor([[0.0, 1, 0, 0]]), torch.zeros(1, 4)]
    assert [p.tolist() for p in rows_needed(masks)] == [[0, 1], [1], []]


def test_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match=r"sparse_loss_chunk_size \(--sparse-loss-chunk-size\) must be >= 1"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=1,
                          sparse_loss_chunk_size=0)
    with pytest.raises(ValueError, match="must be >= 1"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, sparse_lm_loss=True,
                          sparse_loss_chunk_size=0)
