# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_frameworks.py: RL frameworks' own steps, with and without exact_mtp_step.

Each controller makes the calls of one framework's optimizer step in the same order, with the same
loss-function shape, on the library's GPT chunks (docs/integrations/README.md cites each source):

- areal: AReaL's MegatronEngine.train_batch (areal/engine/megatron_engine.py): zero the grads, all-reduce
  the loss weights over DP x CP (compute_total_loss_weight), forward_backward_func with each
  micro-batch's token-mean loss times local_weight / total_weight x DP x loss scale x micro-batches,
  returned as (loss, {}) (averaging mode, calculate_per_token_loss=False), the optimizer's step;
- verl: verl's MegatronPPOActor.update_policy (verl/workers/actor/megatron_actor.py): zero the grads,
  forward_backward_batch with agg_loss's token mean over each micro-batch, returned as
  (loss, [metrics, None]) (averaging mode), the optimizer's step;
- nemo: NeMo-RL's MegatronPolicyWorkerImpl.train (nemo_rl/models/policy/workers/megatron_policy_worker.py):
  the global valid tokens all-reduced, moe_grad_scale_func and mtp_grad_scale_func set to 1/tokens,
  megatron_forward_backward with the loss normalized by the global tokens, / CP and x micro-batches / CP
  (LossPostProcessor), the hooks cleared, the optimizer's step (calculate_per_token_loss=True, DDP sums);
- nemo_split: NeMo-RL's split path (begin_train_step / train_microbatch x chunks / finish_train_step):
  the sync hooks nulled, each chunk under no_sync with placeholder counts of 1 (raw sums), a
  sequence-level loss; at finish the counts all-reduced, scale_gradients(1 / sequences), the saved
  finalize_model_grads, the optimizer's step, the hooks restored.

Each framework gathers the logits' context-parallel pieces before its loss (cp_gathered). With the call
the step is one `with exact_mtp_step(...)` (the split path: enter() at begin, close() after finish).
The reference (tests/reference/gpt_mtp.py) takes the framework's main loss over the whole global batch
plus the spec's (lambda / D) sum_k S_k / N_tok (section 12's objective where the model trains one).
"""

import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.core.fork.mtp.step import StepCounts, exact_mtp_step
from megatron_mtp.library.batches import rank_microbatches
from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from megatron_mtp.library.step import gpt_per_token_loss
from tests.bodies.normalization import BATCH, DEPTHS, GROUPS, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, batch, build
from tests.harness.full_grads import gathered_full_grads, max_rel_to_reference
from tests.harness.layout import model_parallel
from tests.harness.moe_full_grads import gathered_full_grads_and_buffers
from tests.reference.gpt_mtp import ReferenceGPT, draft_objective_sum, mtp_inner_layer_name
from tests.reference.moe import ReferenceMoEGPT, router_loss_terms

LAMBDA = 0.3
MICRO_BATCH = 2
PER_TOKEN_MODE = {"areal": False, "verl": False, "nemo": True, "nemo_split": True}


class _GatherPieces(torch.autograd.Function):
    """All CP ranks' pieces along dim 1. Backward: this rank's piece of the gradient, summed over the
    CP ranks (every rank computes the same loss on the gathered tensor: AReaL and NeMo-RL count that
    cp-fold sum in their normalization) or this rank's own (verl keeps only its piece's gradient)."""

    @staticmethod
    def forward(ctx, piece, group, summed):
        ctx.group, ctx.summed, ctx.size = group, summed, piece.size(1)
        pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, piece.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.summed:
            dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * ctx.size:(rank + 1) * ctx.size], None, None


def cp_gathered(per_token, mask, summed: bool):
    """(per-token loss, mask) of the whole sequences, as the frameworks gather the logits' CP pieces
    (in one order for both, so sums over positions and rows are the full sequences')."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return per_token, mask
    group = parallel_state.get_context_parallel_group()
    pieces = [torch.empty_like(mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, mask.contiguous(), group=group)
    return _GatherPieces.apply(per_token, group, summed), torch.cat(pieces, dim=1)


def _forward_backward(chunks, forward_step, microbatches):
    many = len(chunks) > 1
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches) for _ in chunks] if many else iter(microbatches),
        model=chunks if many else chunks[0], num_microbatches=len(microbatches), seq_length=SEQ,
        micro_batch_size=MICRO_BATCH, forward_only=False)


def _zero(chunks, optimizer):
    optimizer.zero_grad()
    for chunk in chunks:
        chunk.zero_grad_buffer()


def areal_train_batch(chunks, optimizer, microbatches, step, before_forward=lambda: None):
    """`before_forward`: what runs before each micro-batch's forward (a second model's forwards:
    tests/bodies/second_model.py)."""
    _zero(chunks, optimizer)  # optimizer_zero_grad
    weights = torch.stack([mask.sum() for _, mask in microbatches]).sum().float()  # compute_total_loss_weight
    dist.all_reduce(weights, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    multiplier = parallel_state.get_data_parallel_world_size() * optimizer.get_loss_scale().item() * len(microbatches)

    def forward_step(data_iterator, model):
        before_forward()
        tokens, mask = next(data_iterator)
        output, piece = gpt_per_token_loss(model, tokens, mask)

        def process_output(output):  # _compute_logprobs_and_loss
            local_weight = mask.sum()
            if local_weight == 0:
                return output.mean() * 0.0, {}
            ce, full_mask = cp_gathered(output, piece, summed=True)
            loss = (ce * full_mask).sum() / full_mask.sum()  # the token-mean loss_fn
            return loss * (local_weight / weights * multiplier), {}
        return output, process_output

    with step():
        _forward_backward(chunks, forward_step, microbatches)
        optimizer.step()  # optimizer_step


def verl_update_policy(chunks, optimizer, microbatches, step):
    with step():
        _zero(chunks, optimizer)

        def forward_step(data_iterator, model):
            tokens, mask = next(data_iterator)
            output, piece = gpt_per_token_loss(model, tokens, mask)

            def loss_func(output):  # agg_loss(loss_agg_mode="token-mean"), no global batch info
                ce, full_mask = cp_gathered(output, piece, summed=False)
                return (ce * full_mask).sum() / full_mask.sum(), [{}, None]
            return output, loss_func

        _forward_backward(chunks, forward_step, microbatches)  # forward_backward_batch
        optimizer.step()
    optimizer.zero_grad()


def nemo_train(chunks, optimizer, microbatches, step, own_moe_scale: bool = True):
    """`own_moe_scale`: NeMo-RL's moe_grad_scale_func assignment, which the guide's diff removes
    with router losses under the call (the call sets the spec's 1 / T itself)."""
    config = chunks[0].config
    tokens = torch.stack([mask.sum() for _, mask in microbatches]).sum().double()  # process_global_batch
    dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
    cp = parallel_state.get_context_parallel_world_size()
    with step():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        scale = 1.0 / tokens.clamp(min=1).float()
        if own_moe_scale:
            config.moe_grad_scale_func = lambda: scale  # _set_moe_grad_scale_func(_compute_moe_grad_scale(...))
        config.mtp_grad_scale_func = lambda: scale  # _set_mtp_grad_scale_func

        def forward_step(data_iterator, model):
            batch_tokens, mask = next(data_iterator)
            output, piece = gpt_per_token_loss(model, batch_tokens, mask)

            def loss_func(output):  # LossPostProcessor: loss / global tokens, / CP, x micro-batches / CP
                ce, full_mask = cp_gathered(output, piece, summed=True)
                loss = (ce * full_mask).sum() / tokens.float() / cp
                return loss * len(microbatches) / cp, {}
            return output, loss_func

        _forward_backward(chunks, forward_step, microbatches)  # megatron_forward_backward
        config.mtp_grad_scale_func = None
        if own_moe_scale:
            config.moe_grad_scale_func = None
        optimizer.step()


def nemo_split_step(chunks, optimizer, microbatches, step, n_chunks: int = 2):
    import contextlib

    config = chunks[0].config
    cp = parallel_state.get_context_parallel_world_size()
    opened = step()  # begin_train_step: the one call (enter) before the worker's own
    opened.__enter__()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    saved = config.grad_sync_func, config.no_sync_func, config.finalize_model_grads_func
    config.grad_sync_func, config.no_sync_func, config.finalize_model_grads_func = None, contextlib.nullcontext, None
    local = torch.zeros(2, dtype=torch.float64)  # [valid sequences, valid tokens]
    per_chunk = -(-len(microbatches) // n_chunks)
    for first in range(0, len(microbatches), per_chunk):  # train_microbatch, once per chunk
        chunk_batches = microbatches[first:first + per_chunk]
        for _, mask in chunk_batches:
            local += torch.stack([torch.tensor(float(mask.size(0)), dtype=torch.float64), mask.sum().double()])

        def forward_step(data_iterator, model, n=len(chunk_batches)):
            batch_tokens, mask = next(data_iterator)
            output, piece = gpt_per_token_loss(model, batch_tokens, mask)

            def loss_func(output):  # SEQUENCE_LEVEL loss with global_valid_seqs = 1 (raw sums)
                ce, full_mask = cp_gathered(output, piece, summed=True)
                per_sequence = (ce * full_mask).sum(dim=1) / full_mask.sum(dim=1).clamp(min=1)
                return per_sequence.sum() / 1.0 / cp * n / cp, {}
            return output, loss_func

        with contextlib.ExitStack() as no_sync:
            for chunk in chunks:
                no_sync.enter_context(chunk.no_sync())
            _forward_backward(chunks, forward_step, chunk_batches)
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())  # finish_train_step
    for chunk in chunks:
        chunk.scale_gradients(1.0 / max(local[0].item(), 1.0))
    saved[2](chunks, None)
    optimizer.step()
    config.grad_sync_func, config.no_sync_func, config.finalize_model_grads_func = saved
    opened.__exit__(None, None, None)


CONTROLLERS = {"areal": areal_train_batch, "verl": verl_update_policy, "nemo": nemo_train,
               "nemo_split": nemo_split_step}


def main_term(framework: str, main, mask, micro_batch: int = MICRO_BATCH):
    """The framework's main loss on the whole global batch (per-token CE `main` [B, S])."""
    if framework in ("areal", "nemo"):
        return (main * mask).sum() / mask.sum().clamp(min=1)
    if framework == "verl":  # the mean over all micro-batches of each one's token mean
        means = [(main[i:i + micro_batch] * mask[i:i + micro_batch]).sum() / mask[i:i + micro_batch].sum()
                 for i in range(0, main.size(0), micro_batch)]
        return sum(means) / len(means)
    per_sequence = (main * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # nemo_split: / every sequence
    return per_sequence.sum() / main.size(0)


# MoE experts (EP=2 in the matrix tier): no router losses, which a step that averages micro-batches refuses.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0, add_bias_linear=False)
MOE_OPTIONS = dict(MOE, moe_router_score_function="softmax", moe_router_pre_softmax=False,
                   moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                   moe_router_bias_update_rate=0.0, moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
                   moe_router_load_balancing_type="aux_loss", moe_z_loss_coeff=None, swiglu=False)


# Router losses (spec section 11) for the per-token controllers, which the call normalizes by T: an
# auxiliary loss per micro-batch and a z-loss, on the MoE layers of the backbone and the MTP depths.
ROUTER = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)


def reference_grads(state, tokens, mask, framework, detach, objective="ce", temperature=1.0, moe=False,
                    router=False) -> dict:
    kwargs = dict(groups=GROUPS, tied=False, detach_heads=detach, mtp_loss_scaling_factor=LAMBDA,
                  mtp_inner_name=mtp_inner_layer_name(state))
    if moe:
        options = dict(MOE_OPTIONS, moe_ffn_hidden_size=4 * HIDDEN, **(ROUTER if router else {}))
        ref = ReferenceMoEGPT(VOCAB, HIDDEN, HEADS, LAYERS, DEPTHS, options, **kwargs)
    else:
        ref = ReferenceGPT(VOCAB, HIDDEN, HEADS, LAYERS, DEPTHS, **kwargs)
    ref.load_state_dict({k: v for k, v in state.items()
                         if not k.endswith("_extra_state") and not k.endswith("local_tokens_per_expert")})
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits, main, per_depth = ref.losses(inputs, labels, mask)
    mtp = draft_objective_sum(objective, logits, per_depth, None, temperature)
    loss = main_term(framework, main, mask) + LAMBDA / DEPTHS * mtp / mask.sum().clamp(min=1)
    if router:
        loss = loss + sum(router_loss_terms(ref.router_entries, options, MICRO_BATCH).values())
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def _fields(objective: str, moe: bool, router: bool = False) -> dict:
    fields = {} if objective == "ce" else {"mtp_loss_type": objective}
    if moe:
        fields.update(MOE, expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())
    if router:
        fields.update(ROUTER)
    return fields


def run(framework, detach, call, tokens, mask, ckpt, objective="ce", counts=True, moe=False, router=False,
        metrics=False) -> dict:
    """One step of the framework's controller on this layout: every copy of every full gradient
    (captured inside the optimizer's step, after the reduce) and the step's metrics (`metrics`: the
    call's, True on a step the framework logs). With `router`, the MoE router losses too: the call is
    given T (every input position of the global batch), and NeMo-RL's train runs without its
    moe_grad_scale_func line, as its guide's diff says."""
    chunks, optimizer, config = build(detach, lam=LAMBDA, calculate_per_token_loss=PER_TOKEN_MODE[framework],
                                      **_fields(objective, moe, router))
    load_checkpoint(ckpt, chunks)
    microbatches = rank_microbatches(tokens, mask, MICRO_BATCH)
    step_counts = StepCounts(tokens=int(mask.sum()), sequences=int((mask.sum(dim=1) > 0).sum()))
    opened = []

    def step():
        if not call:
            import contextlib
            return contextlib.nullcontext()
        routed = tokens[:, :-1].numel() if router else None  # T: every input position (spec section 11)
        opened.append(exact_mtp_step(chunks, step_counts if counts else None, optimizer=optimizer,
                                     routed_tokens=routed, **({"metrics": True} if metrics else {})))
        return opened[-1]

    captured, original = {}, optimizer.step

    def capturing_step():
        captured["full"] = gathered_full_grads_and_buffers(chunks, config)[0] if moe else gathered_full_grads(chunks)
        return original()

    optimizer.step = capturing_step
    controller = CONTROLLERS[framework]
    if router and call and framework == "nemo":
        controller = functools.partial(nemo_train, own_moe_scale=False)
    try:
        controller(chunks, optimizer, microbatches, step)
    finally:
        optimizer.step = original
    metrics = opened[0].metrics if opened else {}
    return {"full": captured["full"], "metrics": {k: v for k, v in metrics.items() if k != "mtp sums"}}


def trainer_metrics(tokens, mask, ckpt, moe=False) -> dict:
    """The metrics of the trainer's step (megatron_mtp.library.step.train_step, which reports every
    metric) on the same weights and data."""
    from megatron_mtp.library.step import train_step

    chunks, optimizer, _ = build(False, lam=LAMBDA, **_fields("ce", moe))
    load_checkpoint(ckpt, chunks)
    metrics = train_step(chunks, optimizer, rank_microbatches(tokens, mask, MICRO_BATCH), SEQ)
    return {k: v for k, v in metrics.items() if k != "mtp sums"}


def prepare(ckpt_root: str, moe: bool = False) -> dict:
    """The initial weights (one checkpoint per isolation mode) and their state dicts."""
    states = {}
    with model_parallel():
        for detach in (False, True):
            torch.manual_seed(5)
            chunks, _, _ = build(detach, lam=LAMBDA, **_fields("ce", moe))
            save_checkpoint(f"{ckpt_root}/init{int(detach)}{'_moe' if moe else ''}", chunks)
            states[detach] = {k: v.clone() for k, v in chunks[0].module.state_dict().items() if v is not None}
    return states


# (controller, isolation, counts given): the split path streams (sequence level: the heads isolated).
CASES = [("areal", False, True), ("verl", True, True), ("nemo", False, True), ("nemo_split", True, False)]


def cp_rank_without_targets():
    """Tokens and a mask whose valid targets (main and every depth's) all lie on CP rank 1 of two:
    positions 5-8 of 12 (rank 0 holds positions 0-2 and 9-11)."""
    tokens, mask = batch()
    mask[:, :5] = 0.0
    mask[:, 9:] = 0.0
    return tokens, mask


# (controller, isolation, counts given) with router losses: NeMo-RL's train. The averaging controllers
# are refused with router losses (tests/test_frameworks.py's refusals), and so is NeMo-RL's split path
# as it stands: without counts (router losses need them) and with them (its scale_gradients would
# scale the MTP branch too), each in one line (docs/integrations/nemo-rl.md).
ROUTER_CASES = [("nemo", False, True)]


def run_layouts(ckpt_root: str, layouts: list, moe: bool = False, router: bool = False) -> dict:
    """Each layout (name, TP, PP, CP, EP) x controller: the worst deviation from the reference with the
    call and without it (NeMo-RL's train: with it only, see tests/test_frameworks.py); under CP also a
    step where one CP rank has no target at all, and one with the tv draft objective (with the call)."""
    states = prepare(ckpt_root, moe)
    tokens, mask = batch()
    suffix = "_moe" if moe else ""
    out = {}
    for name, tp, pp, cp, ep in layouts:
        with model_parallel(tp=tp, pp=pp, cp=cp, ep=ep):
            # with router losses NeMo-RL's own train differs too (its moe_grad_scale_func is 1 / valid tokens)
            for framework, detach, counts in ROUTER_CASES if router else CASES:
                want = reference_grads(states[detach], tokens, mask, framework, detach, moe=moe, router=router)
                if framework == "areal":
                    want_areal = want
                for call in (True, False) if framework != "nemo" or router else (True,):
                    got = run(framework, detach, call, tokens, mask, f"{ckpt_root}/init{int(detach)}{suffix}",
                              counts=counts, moe=moe, router=router)
                    out[f"{name}/{framework}/{'call' if call else 'without'}"] = {
                        "rel": max_rel_to_reference(got["full"], want), "metrics": got["metrics"]}
            if cp > 1:  # the draft objective tv (spec section 12) through the same call, isolated heads
                want = reference_grads(states[True], tokens, mask, "verl", True, objective="tv")
                got = run("verl", True, True, tokens, mask, f"{ckpt_root}/init1", objective="tv")
                out[f"{name}/verl_tv/call"] = {"rel": max_rel_to_reference(got["full"], want),
                                               "metrics": got["metrics"]}
            if cp > 1:  # a step the framework logs, asked for its metrics, beside the trainer's step
                got = run("areal", False, True, tokens, mask, f"{ckpt_root}/init0", metrics=True)
                out[f"{name}/areal_logged/call"] = {"rel": max_rel_to_reference(got["full"], want_areal),
                                                    "metrics": got["metrics"], "trainer": trainer_metrics(
                                                        tokens, mask, f"{ckpt_root}/init0", moe)}
            if cp > 1:
                empty_tokens, empty_mask = cp_rank_without_targets()
                want = reference_grads(states[False], empty_tokens, empty_mask, "nemo", False)
                got = run("nemo", False, True, empty_tokens, empty_mask, f"{ckpt_root}/init0")
                local = sum(float(m.sum()) for _, m in rank_microbatches(empty_tokens, empty_mask, MICRO_BATCH))
                from megatron.core.fork.runtime import context_parallel
                piece = context_parallel.shard(empty_mask, 1, parallel_state.get_context_parallel_group())
                out[f"{name}/cp_rank_without_targets"] = {
                    "rel": max_rel_to_reference(got["full"], want), "metrics": got["metrics"],
                    "cp_rank": parallel_state.get_context_parallel_rank(), "local_targets": float(piece.sum()),
                    "dp_rank_targets": local}
    return out


def _state_of(chunks, config, optimizer) -> tuple:
    """What a refused step must leave as it was: parameters, gradients, the config's hooks."""
    hooks = tuple(getattr(config, name) for name in (
        "finalize_model_grads_func", "moe_grad_scale_func", "mtp_grad_scale_func", "no_sync_func", "grad_sync_func"))
    params = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    grads = {n: p.main_grad.detach().clone() for n, p in chunks[0].module.named_parameters()}
    return hooks, params, grads


def _unchanged(before: tuple, after: tuple) -> dict:
    return {"hooks": before[0] == after[0],
            "params": all(torch.equal(before[1][n], p) for n, p in after[1].items()),
            "grads_zero": all(float(g.abs().max()) == 0.0 for g in after[2].values())}


def _refused(action) -> str | None:
    try:
        action()
    except ValueError as error:
        return str(error)
    return None


def refusals(ckpt_root: str) -> dict:
    """Each refusal's one-line message, and whether the step left parameters, gradients and hooks
    as before (no optimizer step, nothing accumulated)."""
    from megatron.core.fork.mtp.step import active

    tokens, mask = batch()
    out = {}
    with model_parallel():
        for detach in (False, True):
            torch.manual_seed(5)
            chunks, _, _ = build(detach, lam=LAMBDA)
            save_checkpoint(f"{ckpt_root}/refusal{int(detach)}", chunks)
        chunks, optimizer, config = build(False, lam=LAMBDA, calculate_per_token_loss=False)
        load_checkpoint(f"{ckpt_root}/refusal0", chunks)
        microbatches = rank_microbatches(tokens, mask, MICRO_BATCH)
        counts = StepCounts(tokens=int(mask.sum()), sequences=int((mask.sum(dim=1) > 0).sum()))

        def no_mask_forward(data_iterator, model):  # labels, and no loss_mask: upstream trains everywhere
            batch_tokens, batch_mask = next(data_iterator)
            inputs = batch_tokens[:, :-1]
            positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
            output = model(inputs, positions, None, labels=batch_tokens[:, 1:])
            return output, lambda out: ((out * batch_mask).sum() / batch_mask.sum().clamp(min=1), {})

        def no_mask_step():
            with exact_mtp_step(chunks, counts, optimizer=optimizer):
                _forward_backward(chunks, no_mask_forward, microbatches)
                optimizer.step()

        before = _state_of(chunks, config, optimizer)
        out["no_loss_mask"] = {"message": _refused(no_mask_step),
                               **_unchanged(before, _state_of(chunks, config, optimizer)), "inactive": active() is None}

        wrong = StepCounts(tokens=counts.tokens + 1, sequences=counts.sequences)

        def wrong_counts_step():
            def step():
                return exact_mtp_step(chunks, wrong, optimizer=optimizer)
            areal_train_batch(chunks, optimizer, microbatches, step)

        before = _state_of(chunks, config, optimizer)
        out["wrong_counts"] = {"message": _refused(wrong_counts_step),
                               **_unchanged(before, _state_of(chunks, config, optimizer)), "inactive": active() is None}
        out["streaming_attached"] = _refused(lambda: exact_mtp_step(chunks, None, optimizer=optimizer))
        moe = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, add_bias_linear=False)
        moe_chunks, moe_optimizer, _ = build(True, lam=LAMBDA, calculate_per_token_loss=False, **moe)
        out["router_losses_averaging"] = _refused(lambda: exact_mtp_step(moe_chunks, counts, optimizer=moe_optimizer,
                                                                         routed_tokens=BATCH * SEQ))
    return out


def suite(ckpt_root: str, layouts: list) -> dict:
    """The default tier's launch: the layouts, then the refusals (on this world's DP layout)."""
    return {"layouts": run_layouts(ckpt_root, layouts), "refusals": refusals(ckpt_root)}
