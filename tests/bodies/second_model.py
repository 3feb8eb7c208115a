# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_second_model.py: an actor's exact step beside a second model in the process.

RL workers hold more than one model: verl's ActorRolloutRef worker the actor and its reference
policy, AReaL a reference engine beside the actor. Here the second model has the actor's
architecture, MTP depths included, and shares its TransformerConfig (a worker may build both from
one). It runs forwards before the actor's step and, inside the step, before each of the actor's
micro-batches:

- "labels": a log-prob pass (eval mode, no gradient, labels and loss mask given), whose MTP branch
  computes its depths' losses and statistics;
- "input_ids": a pass on the input ids alone (train mode, no gradient), whose MTP branch derives its
  labels from them and has no loss mask.

The actor's step is AReaL's train_batch wrapped in exact_mtp_step (tests/bodies/frameworks.py), or
a SplitStep in two chunks (the second model's forwards also between the chunks). Its gradients are
compared with the reference (tests/reference/gpt_mtp.py: the token-level main loss on the whole
global batch plus (lambda / D) sum_k S_k / N_tok) and its metrics with the reference's per-depth
sums: the step counts its own model's forwards only.
"""

import torch
from megatron.core import parallel_state

from megatron.core.fork.mtp.step import SplitStep, StepCounts, exact_mtp_step
from megatron_mtp.library.batches import rank_microbatches
from megatron_mtp.library.checkpointing import load_checkpoint
from megatron_mtp.library.model import build_gpt
from megatron_mtp.library.step import global_counts, gpt_forward_step, gpt_per_token_loss
from tests.bodies.frameworks import LAMBDA, MICRO_BATCH, areal_train_batch, prepare, reference_grads
from tests.bodies.normalization import DEPTHS, SEQ, VOCAB, batch, build
from tests.harness.full_grads import gathered_full_grads, max_rel_to_reference
from tests.harness.layout import model_parallel
from tests.reference.gpt_mtp import ReferenceGPT, mtp_inner_layer_name

# (driver, isolation, counts given): a framework's step streams with isolated heads only.
CASES = [("areal", False, True), ("areal", True, True), ("areal", True, False),
         ("split", False, True), ("split", False, False), ("split", True, False)]
FORWARDS = ("labels", "input_ids")


def second_model_forwards(model, tokens, mask, kind: str) -> None:
    """One forward of the second model on a micro-batch (see the module), its outputs dropped."""
    with torch.no_grad():
        if kind == "labels":
            model.eval()
            gpt_per_token_loss(model, tokens, mask)
        else:
            model.train()
            inputs = tokens[:, :-1]
            model(inputs, torch.arange(inputs.size(1)).unsqueeze(0).expand_as(inputs), None)


def reference_metrics(state, tokens, mask) -> dict:
    """Each depth's loss and valid count on the whole global batch, from the reference."""
    from tests.bodies.normalization import GROUPS, HEADS, HIDDEN, LAYERS

    ref = ReferenceGPT(VOCAB, HIDDEN, HEADS, LAYERS, DEPTHS, groups=GROUPS, tied=False,
                       mtp_loss_scaling_factor=LAMBDA, mtp_inner_name=mtp_inner_layer_name(state))
    ref.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")})
    with torch.no_grad():
        _, _, per_depth = ref.losses(tokens[:, :-1], tokens[:, 1:], mask)
    metrics = {}
    for k, (ce, mask_k, _, _) in enumerate(per_depth, start=1):
        metrics[f"mtp_{k} loss"] = float((ce * mask_k).sum() / mask_k.sum())
        metrics[f"mtp_{k} tokens"] = float(mask_k.sum())
    return metrics


def _split_step(chunks, optimizer, microbatches, counts, between):
    def forward_step(data_iterator, model):
        between()
        return gpt_forward_step(data_iterator, model)

    step = SplitStep(chunks, optimizer, forward_step, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    step.begin(global_counts(microbatches)[0] if counts else None)
    half = len(microbatches) // 2
    step.accumulate(microbatches[:half])
    between()
    step.accumulate(microbatches[half:])
    return step.finish()


def run(driver, detach, counts, kind, actor, second, ckpt, tokens, mask) -> dict:
    """One step of the actor with the second model's forwards before it and inside it: the
    actor's full gradients and metrics, or the step's refusal."""
    chunks, optimizer = actor
    load_checkpoint(ckpt, chunks)
    microbatches = rank_microbatches(tokens, mask, MICRO_BATCH)
    local_tokens, local_mask = microbatches[0]

    def between():  # before each of the actor's micro-batches
        second_model_forwards(second, local_tokens, local_mask, kind)

    captured, original = {}, optimizer.step

    def capturing_step():
        captured["full"] = gathered_full_grads(chunks)
        return original()

    optimizer.step = capturing_step
    opened = []
    try:
        for batch_tokens, batch_mask in microbatches:  # before the step
            second_model_forwards(second, batch_tokens, batch_mask, kind)
        if driver == "split":
            metrics = _split_step(chunks, optimizer, microbatches, counts, between)
        else:
            given = StepCounts(tokens=int(mask.sum()), sequences=int((mask.sum(dim=1) > 0).sum()))

            def step():
                opened.append(exact_mtp_step(chunks, given if counts else None, optimizer=optimizer))
                return opened[-1]

            areal_train_batch(chunks, optimizer, microbatches, step, before_forward=between)
            metrics = opened[0].metrics
    except ValueError as refusal:
        return {"refused": str(refusal)}
    finally:
        optimizer.step = original
    return {"full": captured["full"], "metrics": {k: v for k, v in metrics.items() if k != "mtp sums"}}


def suite(ckpt_root: str, tp: int = 2) -> dict:
    """Every case on TP = tp over the rest as data-parallel ranks: the worst deviation of the actor's
    gradients from the reference, its metrics, and the reference's metrics; or the step's refusal."""
    states = prepare(ckpt_root)
    tokens, mask = batch()
    out = {}
    with model_parallel(tp=tp):
        out["dp"] = parallel_state.get_data_parallel_world_size()
        for per_token in (False, True):
            for detach in (False, True):
                cases = [case for case in CASES if case[1] == detach and (case[0] == "split") == per_token]
                if not cases:
                    continue
                chunks, optimizer, config = build(detach, lam=LAMBDA, calculate_per_token_loss=per_token)
                torch.manual_seed(17)
                second = build_gpt(config, VOCAB, SEQ)  # the actor's architecture and config, its own weights
                want = reference_grads(states[detach], tokens, mask, "areal", detach)
                want_metrics = reference_metrics(states[detach], tokens, mask)
                for driver, _, counts in cases:
                    for kind in FORWARDS:
                        got = run(driver, detach, counts, kind, (chunks, optimizer), second,
                                  f"{ckpt_root}/init{int(detach)}", tokens, mask)
                        name = f"{driver}/{'detached' if detach else 'attached'}/" \
                               f"{'counts' if counts else 'streaming'}/{kind}"
                        if "refused" in got:
                            out[name] = got
                            continue
                        out[name] = {"rel": max_rel_to_reference(got["full"], want), "metrics": got["metrics"],
                                     "want_metrics": want_metrics}
    return out
