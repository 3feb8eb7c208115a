"""HybridModel with MTP (one process): a pattern that is the GPT network ("*-" per layer, "/*-"
per MTP depth) on the GPT's weights against the plain-PyTorch reference of
tests/reference/gpt_mtp.py, through the same fork hooks as GPTModel."""

import re

import torch

from megatron_mtp.library.model import build_gpt, build_hybrid
from tests.bodies.mtp_model import (
    LAMBDA, SEQ, SPARSE_CHUNK, VOCAB, make_config, max_rel, padded_batch, reference_for, reference_sums,
    run_megatron,
)
from tests.harness.layout import model_parallel

_ATTENTION = ("input_layernorm", "self_attention")


def hybrid_name(gpt_name: str) -> str:
    """Where a GPT parameter lives in the equivalent hybrid model: layer i's attention half is
    hybrid layer 2i, its MLP half 2i + 1; an MTP depth's layer is its stack of those two."""
    decoder = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", gpt_name)
    if decoder:
        layer, rest = int(decoder.group(1)), decoder.group(2)
        return f"decoder.layers.{2 * layer + (0 if rest.startswith(_ATTENTION) else 1)}.{rest}"
    depth = re.fullmatch(r"mtp\.layers\.(\d+)\.mtp_model_layer\.(.*)", gpt_name)
    if depth:
        rest = depth.group(2)
        return f"mtp.layers.{depth.group(1)}.mtp_model_layer.layers.{0 if rest.startswith(_ATTENTION) else 1}.{rest}"
    return gpt_name.replace("decoder.final_layernorm.", "decoder.final_norm.")


def compare_case(depths: int, detach: bool, sparse: bool) -> dict:
    config = make_config(depths, detach=detach, mtp_sparse_loss=sparse, sparse_loss_chunk_size=SPARSE_CHUNK)
    torch.manual_seed(2000 + depths)
    gpt = build_gpt(config, VOCAB, SEQ)
    hybrid = build_hybrid(make_config(depths, detach=detach, mtp_sparse_loss=sparse,
                                      sparse_loss_chunk_size=SPARSE_CHUNK),
                          VOCAB, SEQ, "*-" * config.num_layers + "/*-" * depths)
    names = {name: hybrid_name(name) for name, _ in gpt.named_parameters()}
    hybrid_params = dict(hybrid.named_parameters())
    errors = {"same_parameters": sorted(names.values()) == sorted(hybrid_params)}
    if not errors["same_parameters"]:
        return errors
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            hybrid_params[names[name]].copy_(param)
    input_ids, labels, mask, _ = padded_batch()
    got = run_megatron(hybrid, input_ids, labels, mask, None)
    ref = reference_for(gpt, depths, False, False, detach)
    _, main_ce, per_depth = ref.losses(input_ids, labels, mask, None)
    ref.objective_sums(input_ids, labels, mask, None).backward()
    errors["main_ce"] = max_rel(got["main_ce"], main_ce.detach())
    errors["grads"] = max(max_rel(got["grads"][names[n]], p.grad) for n, p in ref.named_parameters()
                          if p.grad is not None)
    errors["grad_names"] = sorted(got["grads"]) == sorted(
        names[n] for n, p in ref.named_parameters() if p.grad is not None)
    if len(got["mtp_terms"]) != (1 if sparse else depths):  # not the fork's loss path
        errors["mtp_loss"] = float("inf")
    elif sparse:  # one loss term for all depths
        want = sum((ce * mask_k).sum() for ce, mask_k, _, _ in per_depth) * (LAMBDA / depths)
        errors["mtp_loss"] = max_rel(got["mtp_terms"][0], want.detach())
    else:  # each depth's weighted per-position losses
        errors["mtp_loss"] = max(max_rel(term / (LAMBDA / depths), (ce * mask_k).detach())
                                 for term, (ce, mask_k, _, _) in zip(got["mtp_terms"], per_depth, strict=True))
    sums, ref_sums = got["sums"], reference_sums(per_depth)
    errors["sums"] = float("inf") if sums is None else max_rel(sums, ref_sums)
    errors["counts_exact"] = sums is not None and bool(torch.equal(sums[:, 1:], ref_sums[:, 1:]))
    return errors


def gpt_equivalence() -> dict:
    """D in {1, 2} x isolation off/on x sparse/dense MTP loss (a case that cannot be compared
    reports why: upstream's HybridModel returns no MTP statistics, for one)."""
    results = {}
    with model_parallel():
        for depths in (1, 2):
            for detach in (False, True):
                for sparse in (True, False):
                    name = f"D{depths}_{'isolated' if detach else 'attached'}_{'sparse' if sparse else 'dense'}"
                    try:
                        results[name] = compare_case(depths, detach, sparse)
                    except Exception as error:  # noqa: BLE001 - reported to the test, which fails
                        results[name] = {"error": repr(error)}
    return results
