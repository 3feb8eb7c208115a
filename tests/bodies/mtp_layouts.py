"""MTP across parallel layouts: TP=2, PP=2 (MTP on the last stage) and DP=2 against one process.

Compared after one step: every copy of every parameter's full gradient (TP shards joined,
each TP replica, both word-embedding copies under PP; tests.bodies.full_grads) against the
one-process run's, the main and MTP group norms, the loss and the per-depth MTP sums.
"""

import torch

from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from tests.bodies.full_grads import all_gather_distributed_optimizer_shards, gathered_full_grads, max_rel_to_reference
from tests.bodies.tiny_gpt import Setup, build, train_step
from tests.harness.layout import model_parallel


def group_norms_of_grads(chunks) -> dict:
    """Norm of the (unsharded, one-process) gradients of MTP and of all other parameters."""
    squares = {"main": 0.0, "mtp": 0.0}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            squares["mtp" if name.startswith("mtp.") else "main"] += float(param.main_grad.double().pow(2).sum())
    return {group: total ** 0.5 for group, total in squares.items()}


def one_step(setup: Setup, chunks, optimizer, one_process: bool = False) -> dict:
    """One training step; the full gradients ("grads") captured after finalize, before the
    optimizer clips and steps (with the distributed optimizer: its reduced shards gathered)."""
    distributed_optimizer = setup.distributed_optimizer
    captured = {}
    original_step = optimizer.step

    def step_after_capture():
        if distributed_optimizer:  # each rank holds its shard reduced: gather them
            all_gather_distributed_optimizer_shards(chunks)
        captured["grads"] = gathered_full_grads(chunks)  # final: finalize ran
        if one_process:
            captured["before_clip"] = group_norms_of_grads(chunks)
        outcome = original_step()
        if one_process:
            captured["after_clip"] = group_norms_of_grads(chunks)
        return outcome

    optimizer.step = step_after_capture
    result = train_step(setup, chunks, optimizer, 0)
    optimizer.step = original_step
    result["grads"] = captured.get("grads")
    if one_process:
        result["independent_group_norms"] = {k: captured[k] for k in ("before_clip", "after_clip")}
    return result


def reference(ckpt_root: str, setups: dict) -> dict:
    out = {}
    with model_parallel():
        for name, kwargs in setups.items():
            setup = Setup(**kwargs)
            chunks, optimizer, _ = build(setup)
            save_checkpoint(f"{ckpt_root}/{name}", chunks)
            out[name] = one_step(setup, chunks, optimizer, one_process=True)
            torch.save({n: copies[0] for n, copies in out[name].pop("grads").items()},
                       f"{ckpt_root}/{name}-grads.pt")
    return out


def layouts(ckpt_root: str, layouts: list[dict], setups: dict) -> dict:
    out = {}
    for layout in layouts:
        distributed_optimizer = layout.get("distributed_optimizer", False)
        with model_parallel(tp=layout["tp"], pp=layout["pp"]):
            for name, kwargs in setups.items():
                setup = Setup(**kwargs, distributed_optimizer=distributed_optimizer)
                chunks, optimizer, _ = build(setup)
                load_checkpoint(f"{ckpt_root}/{name}", chunks)
                result = one_step(setup, chunks, optimizer)
                grads = result.pop("grads")
                result["grads_rel"] = max_rel_to_reference(grads, torch.load(f"{ckpt_root}/{name}-grads.pt"))
                out[f"{layout['name']}/{name}"] = result
    return out
