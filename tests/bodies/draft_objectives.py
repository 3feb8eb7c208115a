# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The draft objectives of spec section 12 (kl, tv, e2e_tv; ce at a temperature) in the
patched GPTModel against the plain-PyTorch reference (tests/reference/gpt_mtp.py), which
computes them on whole [b, s, V] softmaxes with torch.minimum and autograd."""

import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.fork.mtp.statistics import (
    GREEDY_ACCEPTED,
    GREEDY_CHAIN_ACCEPTED,
    MEASURED,
    SAMPLED_ACCEPTED,
    SAMPLED_CHAIN_ACCEPTED,
    STEP_STATISTICS,
    VALID,
    metrics_from_sums,
)
from megatron_mtp.library.model import build_gpt
from tests.bodies.mtp_model import (
    LAMBDA,
    SEQ,
    SPARSE_CHUNK,
    VOCAB,
    counts_equal,
    make_config,
    max_rel,
    packed_batch,
    padded_batch,
    reference_for,
    reference_sums,
    run_megatron,
)
from tests.harness.layout import model_parallel
from tests.reference.gpt_mtp import draft_objective_sum

DRAFT_OBJECTIVES = ("kl", "tv", "e2e_tv")
TEMPERATURE = 0.7  # not 1, so a missing or misplaced 1/tau shows


def sharpen(model) -> None:
    """Spread the output weight so p and q differ markedly at every position (the tiny model's
    initial softmaxes are near uniform, where alpha ~ 1 and every objective is nearly flat)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in ("output_layer.weight", "embedding.word_embeddings.weight"):
                param.mul_(6.0)


def align(model) -> None:
    """Make each depth read mostly its input token's embedding (eh_proj's embedding half the
    identity, its hidden half damped), as the main head at t + k reads mostly x_{t+k}'s: the
    depths' argmax then often is the main head's, so the greedy-draft acceptance p(argmax q) is
    neither near 0 (unrelated heads: p is sharp elsewhere) nor near 1 (measured 0.53 .. 0.58 at
    D = 3, with alpha 0.87 .. 0.91)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("eh_proj.weight"):
                hidden = param.size(0)
                param[:, hidden:].mul_(0.1)
                param[:, :hidden].add_(torch.eye(hidden))
            if name in ("output_layer.weight", "embedding.word_embeddings.weight"):
                param.mul_(4.0)  # p sharp enough that p(argmax q) is not bounded low by max_v p


def case(objective, depths, repeated, tied, layout, sparse, temperature=TEMPERATURE, seed=0, aligned=False) -> dict:
    """One step of the model with `objective` and of the reference: gradients, the MTP sums."""
    config = make_config(depths, repeated, detach=True, mtp_sparse_loss=sparse, sparse_loss_chunk_size=SPARSE_CHUNK,
                         mtp_loss_type=objective, mtp_draft_temperature=temperature)
    torch.manual_seed(2000 + 10 * depths + seed)
    model = build_gpt(config, VOCAB, SEQ, share_embeddings_and_output_weights=tied)
    sharpen(model)
    if aligned:
        align(model)
    input_ids, labels, mask, segments = (padded_batch if layout == "padded" else packed_batch)(seed)
    got = run_megatron(model, input_ids, labels, mask, segments)
    ref = reference_for(model, depths, tied, repeated, True)
    logits, _, per_depth = ref.losses(input_ids, labels, mask, segments)
    ref.objective_sums(input_ids, labels, mask, segments, objective, temperature).backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    ref_sums = reference_sums(logits, per_depth, segments, objective, temperature)
    names_match = sorted(got["grads"]) == sorted(ref_grads)
    mtp_names = [name for name in ref_grads if name.startswith("mtp.")]
    return {
        "grad_names": names_match,
        "grads": max(max_rel(got["grads"][n], ref_grads[n]) for n in ref_grads) if names_match else float("inf"),
        "mtp_grads_nonzero": all(bool(ref_grads[n].abs().sum() > 0) for n in mtp_names),
        # e2e_tv trains only at anchors valid at every depth: packed rows of 5, 4 and 3 tokens with
        # holes may have none at D = 3 (then every MTP gradient is 0, the reference's too)
        "complete_chains": int(torch.stack([mask_k != 0 for _, mask_k, _, _ in per_depth]).all(dim=0).sum()),
        "sums": max_rel(got["sums"], ref_sums),
        "counts_exact": counts_equal(got["sums"], ref_sums),
        "sampled_acceptance": (got["sums"][:, SAMPLED_ACCEPTED] / got["sums"][:, VALID]).tolist(),
        "greedy_draft_acceptance": (got["sums"][:, GREEDY_ACCEPTED] / got["sums"][:, VALID]).tolist(),
        # the greedy-draft fields alone against the reference's (the table's largest magnitude, a CE
        # sum, would hide an error in them)
        "greedy_sums": max_rel(got["sums"][:, GREEDY_ACCEPTED:], ref_sums[:, GREEDY_ACCEPTED:]),
    }


def matrix() -> dict:
    """Every draft objective x D in {1, 2, 3} x distinct / repeated x tied / untied x padded /
    packed rows x sparse / dense MTP loss, and ce at a temperature (its sampled acceptance)."""
    results = {}
    with model_parallel():
        for objective, depths, repeated, tied, layout, sparse in itertools.product(
                DRAFT_OBJECTIVES + ("ce",), (1, 2, 3), (False, True), (False, True), ("padded", "packed"),
                (True, False)):
            if repeated and depths == 1:
                continue  # the same model as distinct
            name = (f"{objective}-D{depths}-{'rep' if repeated else 'dist'}-{'tied' if tied else 'untied'}-{layout}-"
                    f"{'sparse' if sparse else 'dense'}")
            results[name] = case(objective, depths, repeated, tied, layout, sparse)
    return results


def without_sampled_metrics() -> dict:
    """ce with mtp_sampled_acceptance off: the same gradients as the reference's, the sampled
    sums measured at no position and their metrics left out."""
    from megatron.core.fork.mtp.statistics import metrics_from_sums

    config = make_config(2, detach=True, mtp_sampled_acceptance=False, sparse_loss_chunk_size=SPARSE_CHUNK)
    with model_parallel():
        torch.manual_seed(4)
        model = build_gpt(config, VOCAB, SEQ)
        input_ids, labels, mask, _ = padded_batch(2)
        got = run_megatron(model, input_ids, labels, mask, None)
        ref = reference_for(model, 2, False, False, True)
        logits, _, per_depth = ref.losses(input_ids, labels, mask)
        ref.objective_sums(input_ids, labels, mask).backward()
        want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        ref_sums = reference_sums(logits, per_depth)
        metrics = metrics_from_sums(got["sums"])
        return {"grads": max(max_rel(got["grads"][n], want[n]) for n in want),
                "first_fields": max_rel(got["sums"][:, :4], ref_sums[:, :4]),
                "sampled_unknown": bool((got["sums"][:, SAMPLED_ACCEPTED:] == 0).all()),
                "reported": sorted(name for name in metrics if "sampl" in name or "greedy" in name)}


class VocabularyRows(TorchDispatchMode):
    """Counts the rows of the outputs over the whole vocabulary (last dimension VOCAB) of the ops in
    `ops` while it is active: PRODUCTS, the rows projected onto the vocabulary; SOFTMAXES, the
    distributions computed (the sampled and greedy-draft acceptances' work under ce: p and q)."""

    PRODUCTS = {getattr(product, overload) for product in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
                for overload in ("default", "out")}
    SOFTMAXES = {torch.ops.aten._softmax.default, torch.ops.aten._softmax.out, torch.ops.aten.softmax.int_out,
                 torch.ops.aten._log_softmax.default, torch.ops.aten._log_softmax.out,
                 torch.ops.aten.log_softmax.int_out}

    def __init__(self, ops=PRODUCTS):
        super().__init__()
        self.ops = ops
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops and out.size(-1) == VOCAB:
            self.rows += out.numel() // VOCAB
        return out


def ce_at_three_depths(seed: int, batch_seed: int) -> tuple:
    """ce at D = 3 and TEMPERATURE, the output weight sharpened, on padded rows (inside
    model_parallel): (config, model, (input_ids, labels, mask), the reference's sums)."""
    config = make_config(3, detach=True, sparse_loss_chunk_size=SPARSE_CHUNK, mtp_draft_temperature=TEMPERATURE)
    torch.manual_seed(seed)
    model = build_gpt(config, VOCAB, SEQ)
    sharpen(model)
    input_ids, labels, mask, _ = padded_batch(batch_seed)
    logits, _, per_depth = reference_for(model, 3, False, False, True).losses(input_ids, labels, mask)
    return config, model, (input_ids, labels, mask), reference_sums(logits, per_depth, None, "ce", TEMPERATURE)


def metric_steps() -> dict:
    """ce at D = 3, one running step built with metrics=False (what a step training_log does not
    print runs) and one with metrics=True: the rows each projects onto the vocabulary in its forward
    and its sums against the reference's; and whether the plain forwards' projections are as before
    the step (off: the library's default) after it."""
    from megatron.core.fork.mtp.step import TOKEN, RunningStep, StepCounts
    from megatron.core.fork.mtp.step.normalization import StepNormalization

    out = {}
    with model_parallel():
        config, model, (input_ids, labels, mask), ref_sums = ce_at_three_depths(seed=5, batch_seed=1)
        counts = StepCounts(tokens=int(mask.sum()), sequences=mask.size(0))
        for metrics in (False, True):
            step = RunningStep([model], StepNormalization(TOKEN, bool(config.mtp_detach_heads), counts),
                               metrics=metrics)
            step.enter()
            try:
                with VocabularyRows() as projections:
                    run_megatron(model, input_ids, labels, mask, None, metrics=None)
                sums = step.statistics.local_sums()  # the step's own record
            finally:
                step.exit()
            out[metrics] = {"rows": projections.rows, "sums": sums, "reporting_after": STEP_STATISTICS.reporting}
    off, on = out[False], out[True]
    return {"main_rows": input_ids.numel(), "rows_off": off["rows"], "rows_on": on["rows"],
            "off_first_fields": max_rel(off["sums"][:, :4], ref_sums[:, :4]),
            "off_counts_exact": counts_equal(off["sums"][:, :4], ref_sums[:, :4]),
            "off_sampled_fields": off["sums"][:, SAMPLED_ACCEPTED:].abs().sum().item(),
            "off_reported": sorted(name for name in metrics_from_sums(off["sums"])
                                   if "sampl" in name or "greedy" in name),
            "on_sums": max_rel(on["sums"], ref_sums), "on_counts_exact": counts_equal(on["sums"], ref_sums),
            "on_sampled": (on["sums"][:, SAMPLED_ACCEPTED] / on["sums"][:, MEASURED]).tolist(),
            "reporting_after": [off["reporting_after"], on["reporting_after"]]}


def library_defaults() -> dict:
    """ce at D = 3, a forward and backward as a framework calling GPTModel gets it (no step, nothing
    set: the library's defaults) and one inside STEP_STATISTICS.report_metrics(): the distributions
    each computes over the vocabulary, and its sums against the reference's."""
    out = {"reporting": STEP_STATISTICS.reporting}
    with model_parallel():
        _, model, (input_ids, labels, mask), ref_sums = ce_at_three_depths(seed=6, batch_seed=4)
        for name, metrics in (("defaults", None), ("asked", True)):
            with VocabularyRows(VocabularyRows.SOFTMAXES) as softmaxes:
                got = run_megatron(model, input_ids, labels, mask, None, metrics=metrics)
            out[name] = {"softmax_rows": softmaxes.rows, "mtp_rows": int(got["sums"][:, VALID].sum()),
                         "first_fields": max_rel(got["sums"][:, :4], ref_sums[:, :4]),
                         "sampled_fields": got["sums"][:, SAMPLED_ACCEPTED:].abs().sum().item(),
                         "sums": max_rel(got["sums"], ref_sums), "counts_exact": counts_equal(got["sums"], ref_sums)}
    out["reporting_after"] = STEP_STATISTICS.reporting
    return out


def default_cases() -> dict:
    """One case per objective and dimension for the default tier: D = 3 distinct and D = 2
    repeated, padded and packed rows, sparse and dense."""
    results = {}
    with model_parallel():
        for objective in DRAFT_OBJECTIVES:
            results[f"{objective}-D3-dist-untied-padded-sparse"] = case(objective, 3, False, False, "padded", True)
            results[f"{objective}-D2-rep-tied-packed-dense"] = case(objective, 2, True, True, "packed", False)
        results["ce-D2-dist-untied-packed-sparse"] = case("ce", 2, False, False, "packed", True)
    return results


def backbone_untouched() -> dict:
    """For each objective: backbone, embedding and output-weight gradients equal a D = 0 run's
    bit for bit (the main head's distribution is a target, never trained by the heads)."""
    out = {}
    with model_parallel():
        for objective in DRAFT_OBJECTIVES + ("ce",):
            torch.manual_seed(7)
            with_mtp = build_gpt(make_config(2, detach=True, mtp_loss_type=objective), VOCAB, SEQ)
            without = build_gpt(make_config(0), VOCAB, SEQ)
            without.load_state_dict(with_mtp.state_dict(), strict=False)
            got, base = run_megatron(with_mtp, *padded_batch()), run_megatron(without, *padded_batch())
            shared = sorted(base["grads"])
            out[objective] = {
                "shared_names": shared == sorted(n for n in got["grads"] if not n.startswith("mtp.")),
                "bit_identical": all(torch.equal(got["grads"][n], base["grads"][n]) for n in shared),
                "mtp_grads_nonzero": all(bool(got["grads"][n].abs().sum() > 0)
                                         for n in got["grads"] if n.startswith("mtp.")),
            }
    return out


def refusal_on_this_build() -> str | None:
    """An isolated tv config on this build: its refusal, or None where it is built."""
    with model_parallel():
        try:
            make_config(2, detach=True, mtp_loss_type="tv")
        except ValueError as error:
            return str(error)
    return None


def refusals() -> dict:
    """Each refused configuration's one-line message, or None where it was built."""

    def error_of(**fields):
        try:
            make_config(2, **fields)
        except ValueError as error:
            return str(error)
        return None

    with model_parallel():
        STEP_STATISTICS.reset()
        return {
            **{f"{objective}_attached": error_of(mtp_loss_type=objective) for objective in DRAFT_OBJECTIVES},
            "unknown": error_of(detach=True, mtp_loss_type="soft_ce"),
            "temperature": error_of(detach=True, mtp_draft_temperature=0.0),
            "upstream_name": error_of(mtp_loss_type="cross_entropy"),
            "ce_attached": error_of(mtp_loss_type="ce"),
        }


def decoder_agrees() -> dict:
    """The trainer's sampled- and greedy-draft-acceptance sums and their chains against the
    decoder's teacher-forced sum_v min(p, q) and p(argmax q) (megatron_mtp.serving.speculative.
    teacher_forced, its own code over the KV-cache runner) on the same text, every position valid:
    two computations of the same numbers."""
    from megatron_mtp.serving import speculative
    from megatron_mtp.serving.kv_cache import CachedSDPACoreAttention
    from megatron_mtp.serving.model import Runner

    with model_parallel():
        torch.manual_seed(5)
        config = make_config(3, detach=True, mtp_loss_type="tv", mtp_draft_temperature=TEMPERATURE)
        model = build_gpt(config, VOCAB, SEQ + 1, core_attention=CachedSDPACoreAttention)
        sharpen(model)
        tokens = torch.randint(1, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(9))
        got = run_megatron(model, tokens[:, :-1], tokens[:, 1:], torch.ones(1, SEQ), None)
        model.eval()
        stats = speculative.Stats(depths=3)
        with torch.no_grad():
            speculative.teacher_forced(Runner(model, VOCAB), tokens[0].tolist(), stats, temperature=TEMPERATURE)
        return {"trainer": got["sums"][:, SAMPLED_ACCEPTED].tolist(), "trainer_valid": got["sums"][:, VALID].tolist(),
                "decoder": stats.teacher_forced_overlap, "decoder_valid": stats.teacher_forced_total,
                "trainer_greedy": got["sums"][:, GREEDY_ACCEPTED].tolist(),
                "decoder_greedy": stats.teacher_forced_greedy,
                "trainer_chains": got["sums"][:, [SAMPLED_CHAIN_ACCEPTED, GREEDY_CHAIN_ACCEPTED]].t().tolist(),
                "decoder_chains": [stats.teacher_forced_overlap_chain, stats.teacher_forced_greedy_chain]}


def sample_mask() -> dict:
    """The MTP-only sample mask r (spec section 12) through the library's gpt_per_token_loss: the
    model's gradients against the reference whose MTP masks are multiplied by r and whose main
    loss is not; and against the same step without r (which must differ)."""
    from megatron.core.transformer import multi_token_prediction

    from megatron_mtp.library.step import gpt_per_token_loss

    with model_parallel():
        torch.manual_seed(11)
        model = build_gpt(make_config(2, detach=True, mtp_loss_type="tv", mtp_draft_temperature=TEMPERATURE),
                          VOCAB, SEQ)
        sharpen(model)
        input_ids, labels, mask, _ = padded_batch(3)
        tokens = torch.cat([input_ids, labels[:, -1:]], dim=1)
        r = torch.tensor([1.0, 0.0, 1.0, 1.0])  # the second response: no MTP training
        grads = {}
        for name, sample_mask in (("with_r", r), ("without_r", None)):
            multi_token_prediction.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            model.zero_grad(set_to_none=True)
            model.train()
            per_token, main_mask = gpt_per_token_loss(model, tokens, mask, sample_mask)
            (per_token * main_mask).sum().backward()
            grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        ref = reference_for(model, 2, False, False, True)
        logits, main, _ = ref.losses(input_ids, labels, mask)
        _, _, masked_depths = ref.losses(input_ids, labels, mask * r.unsqueeze(1))
        total = (main * mask).sum() + LAMBDA / 2 * draft_objective_sum("tv", logits, masked_depths, None, TEMPERATURE)
        total.backward()
        want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        return {name: max(max_rel(got[n], want[n]) for n in want) if sorted(got) == sorted(want) else float("inf")
                for name, got in grads.items()}


def greedy_aligned() -> dict:
    """Depths aligned with the main head (``align``): the greedy-draft acceptance mid-range, for
    ce (at a temperature) and e2e_tv, D = 3, padded rows, the sparse loss."""
    with model_parallel():
        return {objective: case(objective, 3, False, False, "padded", True, aligned=True)
                for objective in ("ce", "e2e_tv")}


def suite(tier: str) -> dict:
    return {"cases": matrix() if tier == "matrix" else default_cases(), "greedy_aligned": greedy_aligned(),
            "backbone": backbone_untouched(),
            "refusals": refusals(), "decoder": decoder_agrees(), "sample_mask": sample_mask(),
            "without_sampled_metrics": without_sampled_metrics(), "metric_steps": metric_steps(),
            "library_defaults": library_defaults()}
