# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What the engine computed, recorded in the engine process:

- the drafter's logits at every draft step, as vLLM's MTP model returned them (its `compute_logits`, one
  row per request drafted), set beside the project's decoder's (speculative.speculative's `draft_logits`)
  draft by draft, not only through the acceptance counts they lead to;
- every sampling step's tokens per request (the model runner's `_sample`: the prefill's token, or a
  verify step's accepted drafts and the token after them, before max_tokens cuts the response), so that
  the project can replay the engine's verify steps and predict what it accepts (serving.engine_replay).

Runs in the engine's interpreter (vllm_server.py's `probe_drafts` op), on the worker through
`LLM.collective_rpc`; the uni executor runs the worker in the engine's own process, so the rows are
kept here until read.
"""

RECORDED: list = []


def wrap(owner, name: str, on: bool, seen) -> None:
    """On: owner.<name> calls `seen(result, *args)` after each call (once, however often it is asked);
    off: the method as it was."""
    saved = f"_unprobed_{name}"
    if on and not hasattr(owner, saved):
        original = getattr(owner, name)
        setattr(owner, saved, original)

        def probed(*args, **kwargs):
            result = original(*args, **kwargs)
            seen(result, *args)
            return result

        setattr(owner, name, probed)
    elif not on and hasattr(owner, saved):
        setattr(owner, name, getattr(owner, saved))
        delattr(owner, saved)


def record(worker, on: bool) -> None:
    """Starts (on) or stops recording the drafter's logits; starting empties what was recorded."""
    if on:
        RECORDED.clear()
    wrap(worker.model_runner.drafter.model, "compute_logits", on,
         lambda logits, *_: RECORDED.append(logits.detach().float().cpu().tolist()))


def recorded(worker) -> list:
    """The rows recorded since recording started: one list per drafter call, one row per request."""
    return list(RECORDED)


STEPS: dict = {}  # request id -> [[drafts verified, [tokens sampled]], ...], one pair per sampling step


def record_steps(worker, on: bool) -> None:
    """Starts (on) or stops recording every sampling step's tokens; starting empties what was recorded."""
    runner = worker.model_runner

    def sampled(output, logits, spec_decode_metadata) -> None:
        count = runner.input_batch.num_reqs
        rows = output.sampled_token_ids[:count].tolist()
        drafts = spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else [0] * count
        discarded = runner.discard_request_mask.np[:count]  # a prefill chunk's row: not a token
        for request, row, verified, skip in zip(runner.input_batch.req_ids[:count], rows, drafts, discarded,
                                                strict=True):
            if not skip:
                STEPS.setdefault(request, []).append([int(verified), [t for t in row if t >= 0]])

    if on:
        STEPS.clear()
    wrap(runner, "_sample", on, sampled)


def recorded_steps(worker) -> dict:
    return {request: list(steps) for request, steps in STEPS.items()}
