# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What the engine's drafter computed: every draft step's logits, as vLLM's MTP model returned them
(its `compute_logits`, one row per request drafted), recorded in the engine process so that they can
be set beside the project's decoder's (speculative.speculative's `draft_logits`) draft by draft, not
only through the acceptance counts they lead to.

Runs in the engine's interpreter (vllm_server.py's `probe_drafts` op), on the worker through
`LLM.collective_rpc`; the uni executor runs the worker in the engine's own process, so the rows are
kept here until read.
"""

RECORDED: list = []


def record(worker, on: bool) -> None:
    """Starts (on) or stops recording the drafter's logits; starting empties what was recorded."""
    model = worker.model_runner.drafter.model
    if on:
        RECORDED.clear()
        if not hasattr(model, "_unprobed_compute_logits"):
            model._unprobed_compute_logits = model.compute_logits

            def compute_logits(*args, **kwargs):
                logits = model._unprobed_compute_logits(*args, **kwargs)
                RECORDED.append(logits.detach().float().cpu().tolist())
                return logits

            model.compute_logits = compute_logits
    elif hasattr(model, "_unprobed_compute_logits"):
        model.compute_logits = model._unprobed_compute_logits
        del model._unprobed_compute_logits


def recorded(worker) -> list:
    """The rows recorded since recording started: one list per drafter call, one row per request."""
    return list(RECORDED)
