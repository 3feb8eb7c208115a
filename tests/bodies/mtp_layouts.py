"""MTP across parallel layouts: TP=2, PP=2 (MTP on the last stage) and DP=2 against one process.

Compared after one step: every parameter's gradient norm (by global name; TP shards are
recombined, replicas across DP and embedding copies across stages taken once), the main
and MTP group norms, the loss and the per-depth MTP sums.
"""

import torch.distributed as dist

from megatron.core import parallel_state
from megatron_mtp.checkpointing import load_checkpoint, save_checkpoint
from tests.bodies.tiny_gpt import Setup, build, train_step
from tests.harness.layout import model_parallel

def global_name(chunk, name: str) -> str:
    """Local parameter name with the decoder layer index made global (pipeline offset)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = chunk.module.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    return ".".join(parts)


def grad_square_norms(chunks) -> dict:
    """{global name: (squared norm of this rank's gradient, split across TP)} after a step's backward."""
    out = {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            grad = param.main_grad
            out[global_name(chunk, name)] = (float(grad.double().pow(2).sum()),
                                             bool(getattr(param, "tensor_model_parallel", False)))
    return out


def gathered_grad_norms(chunks) -> dict:
    mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(), grad_square_norms(chunks))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    combined = {}
    for pp, tp, dp, norms in sorted(everyone, key=lambda e: (e[0], e[1], e[2])):
        if dp != 0:
            continue
        for name, (square, split) in norms.items():
            first_pp, total = combined.get(name, (pp, 0.0))
            if first_pp != pp:
                continue  # a copy on a later stage (embedding for MTP): already counted
            if split or tp == 0:
                combined[name] = (pp, total + square)
    return {name: total ** 0.5 for name, (_, total) in combined.items()}


def group_norms_of_grads(chunks) -> dict:
    """Norm of the (unsharded, one-process) gradients of MTP and of all other parameters."""
    squares = {"main": 0.0, "mtp": 0.0}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            squares["mtp" if name.startswith("mtp.") else "main"] += float(param.main_grad.double().pow(2).sum())
    return {group: total ** 0.5 for group, total in squares.items()}


def one_step(setup: Setup, chunks, optimizer, one_process: bool = False) -> dict:
    captured = {}
    original_step = optimizer.step

    def step_after_capture():
        captured["grads"] = gathered_grad_norms(chunks)  # gradients are final (finalize ran)
        if one_process:
            captured["before_clip"] = group_norms_of_grads(chunks)
        outcome = original_step()
        if one_process:
            captured["after_clip"] = group_norms_of_grads(chunks)
        return outcome

    optimizer.step = step_after_capture
    result = train_step(setup, chunks, optimizer, 0)
    optimizer.step = original_step
    result["param_grad_norms"] = captured["grads"]
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
                if distributed_optimizer:
                    # Gradients are reduce-scattered: each rank holds only its shard, so only
                    # the optimizer's group norms (over all shards) are comparable.
                    result["param_grad_norms"] = None
                out[f"{layout['name']}/{name}"] = result
    return out
