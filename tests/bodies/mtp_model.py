# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Model-level MTP checks (one process): the patched GPTModel against the plain-PyTorch
reference of tests/reference/gpt_mtp.py on the same weights and data."""

import contextlib
import dataclasses
import itertools

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.mtp.statistics import COUNT_FIELDS, STEP_STATISTICS
from megatron_mtp.library.model import build_gpt
from tests.harness.layout import model_parallel
from tests.reference.gpt_mtp import (
    Architecture,
    ReferenceGPT,
    acceptances,
    draft_terms,
    greedy_draft_acceptances,
    mtp_inner_layer_name,
)

VOCAB, HIDDEN, HEADS, GROUPS, LAYERS, SEQ, LAMBDA = 48, 32, 4, 2, 2, 12, 0.3
SPARSE_CHUNK = 7  # rows per chunk of the sparse MTP loss: several chunks, the last one partial


def make_config(depths, repeated=False, detach=False, recompute=False, config_class=TransformerConfig, **extra):
    kwargs = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        mtp_num_layers=depths or None, mtp_loss_scaling_factor=LAMBDA,
        mtp_use_repeated_layer=repeated, mtp_detach_heads=detach,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        calculate_per_token_loss=True,
    )
    kwargs.update(extra)
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return config_class(**kwargs)


def padded_batch(seed=0):
    """4 rows: holes in the token mask, sample 2 dropped by the sample mask, row 3 padded after 7."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (4, SEQ + 1), generator=g)
    tokens[3, 8:] = 0
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    token_mask = (torch.rand(4, SEQ, generator=g) > 0.25).float()
    token_mask[3, 7:] = 0.0  # padding
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    from tests.harness.masks import effective_mask

    return input_ids, labels, effective_mask(token_mask, sample_mask), None


def packed_batch(seed=1):
    """One THD row of segments of 5, 4 and 3 tokens; the last token of each segment has no target."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 4, 3]
    input_ids = torch.randint(1, VOCAB, (1, SEQ), generator=g)
    labels = torch.zeros_like(input_ids)
    mask = (torch.rand(1, SEQ, generator=g) > 0.2).float()
    segments = torch.zeros_like(input_ids)
    start = 0
    for i, n in enumerate(lengths):
        labels[0, start:start + n - 1] = input_ids[0, start + 1:start + n]
        mask[0, start + n - 1] = 0.0
        segments[0, start:start + n] = i
        start += n
    return input_ids, labels, mask, segments


def packed_params(segments):
    counts = torch.bincount(segments[0])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=int(counts.max()), max_seqlen_kv=int(counts.max()))


class Capture:
    """Records MTP per-position weighted losses and output-layer logits during a forward, and
    which logits are the main head's (the MTP branch computes them first where it reads p^k_t
    from them: megatron.core.fork.mtp.loss_branch.main_head_output; else they are the last)."""

    def __init__(self, model):
        self.mtp_terms, self.logits, self.main_at = [], [], -1
        from megatron.core.fork.mtp import loss_branch as heads

        self.heads, self.scaler, self.main_head_output = heads, heads._LossScaler, heads.main_head_output
        self.model = model

    def __enter__(self):
        capture = self

        def apply(hidden, loss):
            capture.mtp_terms.append(loss.detach().clone())
            return capture.scaler.apply(hidden, loss)

        def main_head_output(*args, **kwargs):
            output = capture.main_head_output(*args, **kwargs)
            if output is not None:
                capture.main_at = len(capture.logits) - 1
            return output

        self.heads._LossScaler = type("Recording", (), {"apply": staticmethod(apply)})
        self.heads.main_head_output = main_head_output
        self.hook = self.model.output_layer.register_forward_hook(
            lambda module, args, out: capture.logits.append(out[0].detach().transpose(0, 1).clone())
        )
        return self

    def __exit__(self, *exc):
        self.heads._LossScaler, self.heads.main_head_output = self.scaler, self.main_head_output
        self.hook.remove()

    def split(self):
        """(the main head's logits, or None under sparse_lm_loss; the MTP depths' logits in depth order)."""
        logits = list(self.logits)
        return (logits.pop(self.main_at) if logits else None), logits


def run_megatron(model, input_ids, labels, mask, segments, metrics: bool | None = True):
    """One forward and backward; `metrics`: whether the forward measures the metric projections
    (its sums are compared with every field of the reference's), None: as the running step says."""
    multi_token_prediction.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    STEP_STATISTICS.reset()
    model.zero_grad(set_to_none=True)
    model.train()
    packed = packed_params(segments) if segments is not None else None
    positions = torch.arange(input_ids.size(1)).unsqueeze(0).expand_as(input_ids)
    measuring = STEP_STATISTICS.report_metrics(metrics) if metrics is not None else contextlib.nullcontext()
    with Capture(model) as capture, measuring:
        per_token = model(input_ids, positions, None, labels=labels, loss_mask=mask, packed_seq_params=packed)
    (per_token * mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    main_logits, logits = capture.split()
    return {"main_ce": per_token.detach(), "mtp_terms": capture.mtp_terms, "main_logits": main_logits, "logits": logits,
            "grads": grads, "sums": STEP_STATISTICS.local_sums()}


def reference_for(model, depths, tied, repeated, detach, arch=Architecture()):
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    ref = ReferenceGPT(VOCAB, HIDDEN, HEADS, LAYERS, depths, groups=GROUPS, tied=tied,
                       repeated=repeated, detach_heads=detach, mtp_loss_scaling_factor=LAMBDA,
                       mtp_inner_name=mtp_inner_layer_name(state), arch=arch)
    ref.load_state_dict(state, strict=True)
    return ref


def reference_sums(logits, per_depth, segments=None, objective="ce", temperature=1.0):
    """The reference's per-depth sums in the fork's field order (statistics.FIELDS): the
    objective's term, valid, correct, chain-correct, sampled acceptance and its chain, measured at
    every valid position, greedy-draft acceptance and its chain."""
    with torch.no_grad():
        alphas = acceptances(logits, per_depth, segments, temperature)
        betas = greedy_draft_acceptances(logits, per_depth, segments, temperature)
        terms = draft_terms(objective, logits, per_depth, segments, temperature)
        rows, chain, sampled_chain, greedy_chain = [], None, None, None
        for (_, mask_k, labels_k, lg), alpha, beta, term in zip(per_depth, alphas, betas, terms, strict=True):
            correct = lg.argmax(dim=-1) == labels_k
            chain = correct if chain is None else chain & correct
            sampled_chain = alpha if sampled_chain is None else sampled_chain * alpha
            greedy_chain = beta if greedy_chain is None else greedy_chain * beta
            rows.append([(term * mask_k).sum(), mask_k.sum(), (correct * mask_k).sum(),
                         (chain * mask_k).sum(), (alpha * mask_k).sum(), (sampled_chain * mask_k).sum(),
                         mask_k.sum(), (beta * mask_k).sum(), (greedy_chain * mask_k).sum()])
    return torch.tensor([[float(x) for x in r] for r in rows], dtype=torch.float64)


def counts_equal(sums, ref_sums) -> bool:
    """The integer fields (valid, correct, chain-correct, measured; those present) equal to the last count."""
    fields = [field for field in COUNT_FIELDS if field < sums.size(1)] if sums is not None else []
    return sums is not None and bool(torch.equal(sums[:, fields], ref_sums[:, fields]))


def max_rel(a, b) -> float:
    """Largest deviation relative to b's largest magnitude; NaN or inf counts as infinite."""
    error = ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
    return error if error == error else float("inf")


def against_reference(config, seed, tied, layout, arch=Architecture(), model_options=None):
    """One step of the patched model and of the reference on its weights and a batch:
    (the model's run_megatron results, the reference's losses, its gradients, the mask).
    `model_options`: GPTModel's own arguments (rotary_percent)."""
    torch.manual_seed(seed)
    model = build_gpt(config, VOCAB, SEQ, share_embeddings_and_output_weights=tied, **(model_options or {}))
    if config.layernorm_zero_centered_gamma:  # zero-centred weights start at 0: move them, so (1 + w) is seen
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    param.normal_(0.0, 0.2)
    input_ids, labels, mask, segments = (padded_batch if layout == "padded" else packed_batch)()
    got = run_megatron(model, input_ids, labels, mask, segments)
    ref = reference_for(model, config.mtp_num_layers or 0, tied, config.mtp_use_repeated_layer,
                        config.mtp_detach_heads, arch)
    losses = ref.losses(input_ids, labels, mask, segments)
    ref.objective_sums(input_ids, labels, mask, segments).backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    return got, losses, ref_grads, mask


def compare_case(depths, repeated, tied, detach, recompute, layout, sparse, arch=Architecture(), model_options=None,
                 **fields):
    """`arch` is the reference's architecture, and `fields` the config's (with `model_options`
    GPTModel's) that build the same one."""
    config = make_config(depths, repeated, detach, recompute, mtp_sparse_loss=sparse,
                         sparse_loss_chunk_size=SPARSE_CHUNK, **fields)
    got, (logits, main_ce, per_depth), ref_grads, _ = against_reference(config, 1000 + depths, tied, layout, arch,
                                                                        model_options)
    errors = {
        "main_logits": max_rel(got["main_logits"], logits.detach()),
        "main_ce": max_rel(got["main_ce"], main_ce.detach()),
        "grad_names": sorted(got["grads"]) == sorted(ref_grads),
    }
    if sparse:  # no MTP logits exist beyond one chunk; one loss term for all depths
        want = sum((ce * mask_k).sum() for ce, mask_k, _, _ in per_depth) * (LAMBDA / depths)
        errors["mtp_logits_never_dense"] = len(got["logits"]) == 0
        errors["mtp_loss"] = max_rel(got["mtp_terms"][0], want.detach())
    for k, (ce, mask_k, _, lg) in enumerate(per_depth if not sparse else ()):
        errors[f"mtp{k + 1}_logits"] = max_rel(got["logits"][k], lg.detach())
        errors[f"mtp{k + 1}_loss"] = max_rel(got["mtp_terms"][k] / (LAMBDA / depths), (ce * mask_k).detach())
    errors["grads"] = max(max_rel(got["grads"][n], ref_grads[n]) for n in ref_grads) if errors["grad_names"] else 1.0
    sums, ref_sums = got["sums"], reference_sums(logits, per_depth, None if layout == "padded" else packed_batch()[3])
    errors["sums"] = max_rel(sums, ref_sums)
    errors["counts_exact"] = counts_equal(sums, ref_sums)
    return errors


def reference_matrix() -> dict:
    """Every combination of depth, repeated, tied, isolation, recompute, row layout and
    MTP loss path (sparse and chunked, or dense as upstream)."""
    results = {}
    with model_parallel():
        for depths, repeated, tied, detach, recompute, layout, sparse in itertools.product(
            (1, 2, 3), (False, True), (False, True), (False, True), (False, True), ("padded", "packed"),
            (True, False),
        ):
            if repeated and depths == 1:
                continue  # same model as distinct
            name = f"D{depths}-{'rep' if repeated else 'dist'}-{'tied' if tied else 'untied'}-" \
                   f"{'iso' if detach else 'att'}-{'recomp' if recompute else 'norecomp'}-{layout}-" \
                   f"{'sparse' if sparse else 'dense'}"
            results[name] = compare_case(depths, repeated, tied, detach, recompute, layout, sparse)
    return results


def isolation_leaves_the_backbone_alone() -> dict:
    """Isolation on: backbone, embedding and output-weight gradients equal a D = 0 run's."""
    out = {}
    with model_parallel():
        for depths, repeated, tied, layout in itertools.product((1, 3), (False, True), (False, True),
                                                                ("padded", "packed")):
            if repeated and depths == 1:
                continue
            torch.manual_seed(7)
            with_mtp = build_gpt(make_config(depths, repeated, detach=True), VOCAB, SEQ,
                                 share_embeddings_and_output_weights=tied)
            without = build_gpt(make_config(0), VOCAB, SEQ, share_embeddings_and_output_weights=tied)
            without.load_state_dict(with_mtp.state_dict(), strict=False)
            batch = (padded_batch if layout == "padded" else packed_batch)()
            got, base = run_megatron(with_mtp, *batch), run_megatron(without, *batch)
            shared = sorted(base["grads"])
            name = f"D{depths}-{'rep' if repeated else 'dist'}-{'tied' if tied else 'untied'}-{layout}"
            out[name] = {
                "shared_names": shared == sorted(n for n in got["grads"] if not n.startswith("mtp.")),
                "max_abs_diff": max((got["grads"][n] - base["grads"][n]).abs().max().item() for n in shared),
                "mtp_grads_nonzero": all(got["grads"][n].abs().sum().item() > 0
                                         for n in got["grads"] if n.startswith("mtp.")),
                "mtp_tagged": all(getattr(p, "grad_norm_group", None) == "mtp"
                                  for n, p in with_mtp.named_parameters() if n.startswith("mtp.")),
            }
    return out


def refusals() -> dict:
    """Bad input is refused with a message before any state changes."""
    messages = {}

    def error_of(fn):
        try:
            fn()
        except (ValueError, RuntimeError) as error:
            return str(error)
        return None

    with model_parallel():
        messages["detach_without_depths"] = error_of(lambda: make_config(0, detach=True))
        messages["repeated_without_depths"] = error_of(lambda: make_config(0, repeated=True))
        messages["negative_weight"] = error_of(
            lambda: make_config(2).__class__(**{**vars(make_config(2)), "mtp_loss_scaling_factor": -1.0}))

        model = build_gpt(make_config(2, detach=True), VOCAB, SEQ)
        input_ids, labels, mask, _ = padded_batch()
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(input_ids)
        STEP_STATISTICS.reset()
        messages["mask_shape"] = error_of(
            lambda: model(input_ids, positions, None, labels=labels, loss_mask=mask[:, :-1]))
        messages["statistics_untouched"] = STEP_STATISTICS.local_sums() is None

        model.output_layer.bias = torch.nn.Parameter(torch.zeros(VOCAB))
        messages["trainable_bias"] = error_of(
            lambda: model(input_ids, positions, None, labels=labels, loss_mask=mask))
    return messages


def labels_derived_from_input_ids() -> dict:
    """No labels (an RL/SFT backbone owns the main loss): the model returns logits and its
    MTP heads train on targets derived from input_ids, as with labels = ids shifted by one."""
    with model_parallel():
        torch.manual_seed(3)
        model = build_gpt(make_config(2, detach=True), VOCAB, SEQ)
        input_ids, _, mask, _ = padded_batch()
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(input_ids)
        model.train()
        multi_token_prediction.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        STEP_STATISTICS.reset()
        with STEP_STATISTICS.report_metrics():  # every field compared with run_megatron's
            logits = model(input_ids, positions, None, labels=None, loss_mask=mask)
        derived_sums = STEP_STATISTICS.local_sums()
        logits.sum().backward()
        mtp_grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.")}

        labels = torch.zeros_like(input_ids)
        labels[:, :-1] = input_ids[:, 1:]
        explicit_mask = mask.clone()
        explicit_mask[:, -1] = 0.0
        got = run_megatron(model, input_ids, labels, explicit_mask, None)
        return {
            "logits_shape": list(logits.shape),
            "sums_equal": bool(torch.allclose(derived_sums, got["sums"], rtol=1e-6, atol=0)),
            "mtp_grads_equal": all(torch.allclose(mtp_grads[n], got["grads"][n], rtol=1e-5, atol=1e-7)
                                   for n in mtp_grads),
        }


def zero_depths_is_no_mtp() -> dict:
    """mtp_num_layers=0 (valid upstream: no MTP) trains exactly as mtp_num_layers=None."""
    out = {}
    with model_parallel():
        runs = []
        for depths in (0, None):
            torch.manual_seed(13)
            config = dataclasses.replace(make_config(0), mtp_num_layers=depths)  # validated again
            runs.append(run_megatron(build_gpt(config, VOCAB, SEQ), *padded_batch()))
        zero, none = runs
        out["same_loss"] = bool(torch.equal(zero["main_ce"], none["main_ce"]))
        out["same_grads"] = sorted(zero["grads"]) == sorted(none["grads"]) and all(
            torch.equal(zero["grads"][n], none["grads"][n]) for n in none["grads"])
    return out


def model_suite(ckpt_dir: str) -> dict:
    return {
        "zero_depths": zero_depths_is_no_mtp(),
        "repeated_after_resume": repeated_layer_after_resume(ckpt_dir),
        "matrix": reference_matrix(),
        "isolation": isolation_leaves_the_backbone_alone(),
        "refusals": refusals(),
        "derived_labels": labels_derived_from_input_ids(),
    }


def repeated_layer_after_resume(ckpt_dir: str) -> dict:
    """Repeated mode after a dist-checkpoint round trip (upstream issue #6965: one depth's
    gradient overwrote another's after resume): still the sum of all depths' terms."""
    from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint

    out = {}
    with model_parallel():
        for detach in (False, True):
            torch.manual_seed(21)
            config = make_config(3, repeated=True, detach=detach)
            saved = build_gpt(config, VOCAB, SEQ)
            wrapper = type("Chunk", (), {"module": saved})
            save_checkpoint(f"{ckpt_dir}/rep{int(detach)}", [wrapper])
            torch.manual_seed(99)
            resumed = build_gpt(config, VOCAB, SEQ)
            load_checkpoint(f"{ckpt_dir}/rep{int(detach)}", [type("Chunk", (), {"module": resumed})])
            batch = padded_batch()
            got = run_megatron(resumed, *batch)
            ref = reference_for(resumed, 3, False, True, detach)
            ref.objective_sums(*batch[:3]).backward()
            want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            loaded = all(torch.equal(p, dict(saved.named_parameters())[n]) for n, p in resumed.named_parameters())
            error = max(max_rel(got["grads"][n], want[n]) for n in want)
            out[f"detach{int(detach)}"] = error if loaded else float("inf")
    return out
