# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_normalization.py: exact step normalization against the reference.

The oracle is tests/reference/gpt_mtp.py on the whole global batch with the spec's
objective L = L_main + (lambda / D) * sum_k S_k / N_tok, token- or sequence-level main loss.
"""

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.fork.mtp.step import SplitStep, StepCounts, active
from megatron.core.fork.runtime import compat
from megatron_mtp.library.batches import rank_microbatches
from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from megatron_mtp.library.model import build_model
from megatron_mtp.library.step import global_counts, gpt_forward_step
from tests.bodies.mtp_model import max_rel as tensor_rel
from tests.harness.full_grads import gathered_full_grads, max_rel_to_reference
from tests.harness.layout import model_parallel
from tests.reference.gpt_mtp import ReferenceGPT, draft_objective_sum, mtp_inner_layer_name

VOCAB, HIDDEN, HEADS, GROUPS, LAYERS, SEQ, DEPTHS, BATCH = 48, 32, 4, 2, 4, 12, 2, 8


def batch(kind: str = "uneven"):
    """Tokens [8, 13] and a mask [8, 12]: samples 0-1 sparse, 5 fully masked, the rest dense.
    kind="zero": no valid token at all; kind="rank0-empty": samples 0-1 fully masked."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    mask[0, 2:] = 0.0
    mask[1, :9] = 0.0
    mask[5] = 0.0
    if kind == "zero":
        mask.zero_()
    elif kind == "rank0-empty":
        mask[:2] = 0.0
    return tokens, mask


def reference_grads(state: dict, tokens, mask, level: str, detach: bool, lam: float, objective: str = "ce",
                    temperature: float = 1.0) -> dict:
    ref = ReferenceGPT(VOCAB, HIDDEN, HEADS, LAYERS, DEPTHS, groups=GROUPS, tied=False,
                       detach_heads=detach, mtp_loss_scaling_factor=lam,
                       mtp_inner_name=mtp_inner_layer_name(state))
    ref.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")})
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits, main, per_depth = ref.losses(inputs, labels, mask)
    n_tok = mask.sum()
    per_seq_tokens = mask.sum(dim=1)
    if level == "token":
        loss = (main * mask).sum() / n_tok.clamp(min=1)
    else:
        valid = per_seq_tokens > 0
        seq_means = (main * mask).sum(dim=1) / per_seq_tokens.clamp(min=1)
        loss = seq_means[valid].sum() / valid.sum().clamp(min=1)
    loss = (loss + lam / DEPTHS * draft_objective_sum(objective, logits, per_depth, None, temperature)
            / n_tok.clamp(min=1))
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def build(detach: bool, lam: float = 0.3, fp16: bool = False, clip_grad: float = 1e9,
          loss_scale: float | None = None, sequence_parallel: bool = False,
          position_embedding_type: str = "rope", calculate_per_token_loss: bool = True, **fields):
    """Model chunks (one per virtual stage of the current layout) and optimizer; `fields`: more
    TransformerConfig fields (MoE, a draft objective)."""
    dtype = torch.float16 if fp16 else torch.float32
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=lam, mtp_detach_heads=detach,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, fp16=fp16,
        params_dtype=dtype, pipeline_dtype=dtype, calculate_per_token_loss=calculate_per_token_loss,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel, **fields,
    )
    chunks = build_model(config, VOCAB, SEQ, share_embeddings_and_output_weights=False,
                         position_embedding_type=position_embedding_type)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=clip_grad, fp16=fp16, params_dtype=dtype,
                        initial_loss_scale=loss_scale, loss_scale_window=1000, hysteresis=1), chunks)
    return chunks, optimizer, config


def local_grads(chunks) -> dict:
    return {n: p.main_grad.detach().float().clone() for n, p in chunks[0].module.named_parameters()}


def dict_forward_step(data_iterator, model):
    batch = next(data_iterator)
    return gpt_forward_step(iter([(batch["tokens"], batch["loss_mask"])]), model)


def run_step(chunks, optimizer, tokens, mask, micro_batch: int, n_chunks: int, level: str,
             counts_up_front: bool, capture_grads: bool = True, as_dicts: bool = False,
             metrics: bool | None = True) -> dict:
    """One split step over this rank's share; gradients captured just before the update. `metrics`:
    begin()'s (every metric, as the cuts compare them); None: begin()'s default."""
    microbatches = rank_microbatches(tokens, mask, micro_batch)
    forward_step = gpt_forward_step
    if as_dicts:  # as RL frameworks pass them: the step never looks inside a micro-batch
        microbatches = [{"tokens": t, "loss_mask": m} for t, m in microbatches]
        forward_step = dict_forward_step
    step = SplitStep(chunks, optimizer, forward_step, seq_length=SEQ, micro_batch_size=micro_batch, main_loss=level)
    captured = {}
    original = optimizer.step

    def capturing_step():
        if capture_grads:
            captured["grads"] = local_grads(chunks)
            captured["full_grads"] = gathered_full_grads(chunks)
        return original()

    optimizer.step = capturing_step
    try:
        step.begin(global_counts(rank_microbatches(tokens, mask, micro_batch))[0] if counts_up_front else None,
                   **({} if metrics is None else {"metrics": metrics}))
        per_chunk = -(-len(microbatches) // n_chunks)
        for i in range(0, len(microbatches), per_chunk):
            step.accumulate(microbatches[i:i + per_chunk])
        result = step.finish()
    finally:
        optimizer.step = original
    result.update(captured)
    return result


def max_rel(got: dict, want: dict) -> float:
    """Largest relative deviation over parameters (NaN counts as infinite)."""
    return max(tensor_rel(got[name], ref) for name, ref in want.items())


def single_process(ckpt_root: str) -> dict:
    out = {}
    tokens, mask = batch()
    with model_parallel():
        for detach in (False, True):
            chunks, optimizer, _ = build(detach)
            save_checkpoint(f"{ckpt_root}/init_detach{int(detach)}", chunks)
            state = {k: v.clone() for k, v in chunks[0].module.state_dict().items() if v is not None}
            torch.save(state, f"{ckpt_root}/state_detach{int(detach)}.pt")
            for level in ("token", "sequence"):
                want = reference_grads(state, tokens, mask, level, detach, 0.3)
                torch.save(want, f"{ckpt_root}/ref_detach{int(detach)}_{level}.pt")
                for up_front in (True, False):
                    if level == "sequence" and not detach and not up_front:
                        continue  # refused: tested below
                    for micro_batch, n_chunks in ((1, 1), (1, 2), (1, 4), (2, 1), (4, 1), (2, 4)):
                        load_checkpoint(f"{ckpt_root}/init_detach{int(detach)}", chunks)
                        got = run_step(chunks, optimizer, tokens, mask, micro_batch, n_chunks, level, up_front)
                        key = f"detach{int(detach)}/{level}/{'upfront' if up_front else 'streaming'}/" \
                              f"mbs{micro_batch}/chunks{n_chunks}"
                        out[key] = {"rel": max_rel(got.pop("grads"), want), "metrics": _metrics(got)}
                        got.pop("full_grads")
            # Dict micro-batches (as RL frameworks pass them), sequence-level, streaming.
            load_checkpoint(f"{ckpt_root}/init_detach{int(detach)}", chunks)
            got = run_step(chunks, optimizer, tokens, mask, 2, 2, "sequence", detach is False, as_dicts=True)
            out[f"dict_microbatches_detach{int(detach)}"] = max_rel(
                got["grads"], torch.load(f"{ckpt_root}/ref_detach{int(detach)}_sequence.pt"))
        out["default_metrics"] = default_metrics(ckpt_root, tokens, mask)
        if compat.carries_draft_objectives():  # 0.16.1's series trains ce only (refused there)
            out["draft_objective"] = draft_objective_cuts(ckpt_root, tokens, mask)
        out["refusal"] = refusal()
        out["zero_tokens"] = zero_token_step()
        out["lambda"] = isolation_and_lambda(tokens, mask)
        out["fp16"] = fp16_loss_scale(ckpt_root, tokens, mask)
        out["abort"] = abort_restores(tokens, mask)
    return out


def default_metrics(ckpt_root, tokens, mask) -> dict:
    """One split step with begin()'s default and the same step asked for its metrics (token level,
    counts up front, isolation off): the gradients of each against the reference, and their metrics."""
    chunks, optimizer, _ = build(False)
    want = torch.load(f"{ckpt_root}/ref_detach0_token.pt")
    out = {}
    for name, metrics in (("default", None), ("asked", True)):
        load_checkpoint(f"{ckpt_root}/init_detach0", chunks)
        got = run_step(chunks, optimizer, tokens, mask, 2, 2, "token", True, metrics=metrics)
        out[name] = {"rel": max_rel(got["grads"], want), "metrics": _metrics(got)}
    return out


def draft_objective_cuts(ckpt_root, tokens, mask) -> dict:
    """A draft objective of spec section 12 (e2e_tv, which couples the depths, at temperature 0.8)
    through split steps: sequence-level main loss, counts up front and streaming, cut three ways."""
    chunks, optimizer, _ = build(True, mtp_loss_type="e2e_tv", mtp_draft_temperature=0.8)
    save_checkpoint(f"{ckpt_root}/init_e2e_tv", chunks)
    state = {k: v.clone() for k, v in chunks[0].module.state_dict().items() if v is not None}
    want = reference_grads(state, tokens, mask, "sequence", True, 0.3, "e2e_tv", 0.8)
    out = {}
    for up_front in (True, False):
        for micro_batch, n_chunks in ((1, 4), (2, 1), (4, 1)):
            load_checkpoint(f"{ckpt_root}/init_e2e_tv", chunks)
            got = run_step(chunks, optimizer, tokens, mask, micro_batch, n_chunks, "sequence", up_front)
            out[f"{'upfront' if up_front else 'streaming'}-mbs{micro_batch}-chunks{n_chunks}"] = max_rel(
                got["grads"], want)
    return out


def _metrics(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("grads", "full_grads")}


def refusal() -> dict:
    """Isolation off + sequence-level + no counts: refused at begin(), nothing changed."""
    chunks, optimizer, config = build(detach=False)
    grads_before = local_grads(chunks)
    params_before = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    hooks_before = (config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func)
    step = SplitStep(chunks, optimizer, gpt_forward_step, seq_length=SEQ, micro_batch_size=2, main_loss="sequence")
    message = None
    try:
        step.begin(None)
    except ValueError as error:
        message = str(error)
    return {
        "message": message,
        "in_progress": step.in_progress,
        "active": active() is not None,
        "hooks_unchanged": hooks_before == (config.finalize_model_grads_func, config.no_sync_func,
                                            config.grad_sync_func),
        "grads_unchanged": all(torch.equal(grads_before[n], g) for n, g in local_grads(chunks).items()),
        "params_unchanged": all(torch.equal(params_before[n], p) for n, p in chunks[0].module.named_parameters()),
    }


def zero_token_step() -> dict:
    out = {}
    tokens, mask = batch("zero")
    for up_front in (True, False):
        chunks, optimizer, _ = build(detach=True)
        got = run_step(chunks, optimizer, tokens, mask, 2, 2, "token", up_front)
        grads = got.pop("grads")
        out["upfront" if up_front else "streaming"] = {
            "finite": all(torch.isfinite(g).all().item() for g in grads.values()),
            "max_abs": max(g.abs().max().item() for g in grads.values()),
            "lm loss": got["lm loss"], "tokens": got["tokens"],
            "metrics_finite": all(v == v for k, v in got.items() if isinstance(v, float)),
        }
    return out


def isolation_and_lambda(tokens, mask) -> dict:
    """Isolation on: the main norm does not depend on lambda; the MTP norm scales with it."""
    out = {}
    for lam in (0.1, 0.5):
        torch.manual_seed(5)
        chunks, optimizer, _ = build(detach=True, lam=lam)
        got = run_step(chunks, optimizer, tokens, mask, 2, 2, "token", True, capture_grads=False)
        out[str(lam)] = got["grad norms"]
    return out


def fp16_loss_scale(ckpt_root, tokens, mask) -> dict:
    """fp16, loss scale 2**12: after unscaling, group norms equal the reference's (ratio 1);
    an absurd scale overflows and the whole step is skipped."""
    want = torch.load(f"{ckpt_root}/ref_detach1_token.pt")
    ref_norms = {"main": sum(g.double().pow(2).sum() for n, g in want.items() if not n.startswith("mtp.")) ** 0.5,
                 "mtp": sum(g.double().pow(2).sum() for n, g in want.items() if n.startswith("mtp.")) ** 0.5}
    chunks, optimizer, _ = build(detach=True, fp16=True, loss_scale=2.0 ** 12)
    load_checkpoint(f"{ckpt_root}/init_detach1", chunks)
    got = run_step(chunks, optimizer, tokens, mask, 2, 2, "token", True, capture_grads=False)
    ratios = {g: got["grad norms"][g] / float(ref_norms[g]) for g in ("main", "mtp")}

    chunks, optimizer, _ = build(detach=True, fp16=True, loss_scale=2.0 ** 40)
    before = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    overflow = run_step(chunks, optimizer, tokens, mask, 2, 2, "token", True, capture_grads=False)
    unchanged = all(torch.equal(before[n], p) for n, p in chunks[0].module.named_parameters())
    return {"ratios": ratios, "skipped_normal": got["skipped"], "overflow_skipped": overflow["skipped"],
            "overflow_params_unchanged": unchanged}


def abort_restores(tokens, mask) -> dict:
    """abort() mid-step: gradients zero, hooks and scales as before, no update; an
    exception inside accumulate aborts by itself."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    chunks, optimizer, config = build(detach=True)
    hooks = (config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func)
    scale = MTPLossAutoScaler.main_loss_backward_scale
    params = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    microbatches = rank_microbatches(tokens, mask, 2)
    step = SplitStep(chunks, optimizer, gpt_forward_step, seq_length=SEQ, micro_batch_size=2)
    step.begin(StepCounts(**vars(global_counts(microbatches)[0])))
    step.accumulate(microbatches[:2])
    try:
        save_checkpoint("/nonexistent/never-written", chunks, optimizer)
        checkpoint_refused = False
    except RuntimeError:
        checkpoint_refused = True
    step.abort()
    clean = {
        "checkpoint_refused_mid_step": checkpoint_refused,
        "grads_zero": all(g.abs().max().item() == 0 for g in local_grads(chunks).values()),
        "hooks_restored": hooks == (config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func),
        "scale_restored": MTPLossAutoScaler.main_loss_backward_scale is scale,
        "inactive": active() is None and not step.in_progress,
        "params_unchanged": all(torch.equal(params[n], p) for n, p in chunks[0].module.named_parameters()),
    }

    def failing_forward(it, model):
        raise RuntimeError("data loader failed")

    broken = SplitStep(chunks, optimizer, failing_forward, seq_length=SEQ, micro_batch_size=2)
    broken.begin(None)
    try:
        broken.accumulate(microbatches)
    except RuntimeError:
        pass
    clean["exception_aborts"] = active() is None and not broken.in_progress and \
        hooks == (config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func)
    # A following step works normally.
    clean["next_step_ok"] = not run_step(chunks, optimizer, tokens, mask, 2, 1, "token", True,
                                         capture_grads=False)["skipped"]
    return clean


def parallel_layouts(ckpt_root: str, layouts: list) -> dict:
    """Each layout (name, TP, PP, VPP, sequence parallel, chunks per step, CP) against the
    single-process reference: every copy of every parameter's full gradient (all TP shards,
    stages, virtual chunks, both word-embedding copies), micro-batches of 1."""
    out = {}
    for name, tp, pp, vpp, sequence_parallel, n_chunks, cp in layouts:
        with model_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp):
            dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
            for detach in (False, True):
                for level, up_front, kind in (("token", True, "uneven"), ("token", False, "uneven"),
                                              ("sequence", True, "uneven"), ("sequence", False, "uneven"),
                                              ("token", True, "rank0-empty"), ("token", False, "rank0-empty")):
                    if (kind == "rank0-empty" and name != "dp4") or (level == "sequence" and not up_front
                                                                     and not detach):
                        continue  # (the refused combination is tested in one process)
                    tokens, mask = batch(kind)
                    chunks, optimizer, _ = build(detach, sequence_parallel=sequence_parallel)
                    load_checkpoint(f"{ckpt_root}/init_detach{int(detach)}", chunks)
                    got = run_step(chunks, optimizer, tokens, mask, 1, n_chunks, level, up_front)
                    if kind == "uneven":
                        want = torch.load(f"{ckpt_root}/ref_detach{int(detach)}_{level}.pt")
                    else:
                        state = torch.load(f"{ckpt_root}/state_detach{int(detach)}.pt")
                        want = reference_grads(state, tokens, mask, level, detach, 0.3)
                    key = f"{name}/detach{int(detach)}/{level}/{'upfront' if up_front else 'streaming'}/{kind}"
                    full = got.pop("full_grads")
                    out[key] = {
                        "full_rel": max_rel_to_reference(full, want),
                        "copies": {n: len(copies) for n, copies in full.items()},
                        "finite": all(torch.isfinite(g).all().item() for copies in full.values() for g in copies),
                        "local_tokens": int(mask[dp_rank * (BATCH // dp):(dp_rank + 1) * (BATCH // dp)].sum()),
                        "metrics": _metrics(got),
                    }
    return out


def parallel_layouts_and_refusals(ckpt_root: str, layouts: list, refusal_layouts: list) -> dict:
    return {"layouts": parallel_layouts(ckpt_root, layouts),
            "refusals": learned_absolute_positions_under_pp(refusal_layouts)}


def learned_absolute_positions_under_pp(layouts: list) -> dict:
    """MTP with learned absolute positions: refused on every rank under PP, built without."""
    out = {}
    for name, tp, pp in layouts:
        with model_parallel(tp=tp, pp=pp):
            try:
                build(False, position_embedding_type="learned_absolute")
                out[name] = None
            except ValueError as error:
                out[name] = str(error)
    return out


def upstream_default_mode(ckpt_root: str) -> dict:
    """Pristine upstream's default mode (each micro-batch normalized by its own counts,
    DDP averaging over DP ranks) on DP=4 with uneven tokens, for comparison."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    with model_parallel():
        config = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
            mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=0.3, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, calculate_per_token_loss=False)
        chunks = build_model(config, VOCAB, SEQ, share_embeddings_and_output_weights=False)
        load_checkpoint(f"{ckpt_root}/init_detach0", chunks)
        tokens, mask = batch()
        # Micro-batches of 2, so that no micro-batch has zero valid tokens at any depth:
        # upstream would divide by zero there (NaN), and the point here is its normalization.
        microbatches = rank_microbatches(tokens, mask, 2)

        def loss_func(loss_mask, per_token):
            return (per_token.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1), {}

        def forward_step(it, model):
            t, m = next(it)
            inputs = t[:, :-1]
            positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
            return model(inputs, positions, None, labels=t[:, 1:], loss_mask=m), partial(loss_func, m)

        chunks[0].zero_grad_buffer()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(microbatches),
                                    model=chunks[0], num_microbatches=len(microbatches), seq_length=SEQ,
                                    micro_batch_size=2, forward_only=False)
        want = torch.load(f"{ckpt_root}/ref_detach0_token.pt")
        got = local_grads(chunks)
        mtp = {n: g for n, g in want.items() if n.startswith("mtp.")}
        import megatron.core

        return {"core": megatron.core.__file__, "rel_all": max_rel(got, want), "rel_mtp": max_rel(got, mtp),
                "finite": all(torch.isfinite(g).all().item() for g in got.values())}

