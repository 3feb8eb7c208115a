# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MTP across parallel layouts: TP=2, PP=2 (MTP on the last stage) and DP=2 against one process,
and upstream's pipeline layouts with `m` (megatron-core's `pipeline_model_parallel_layout`):
the MTP depths on a stage of their own, alone with the loss or before the loss stage, also on
the last virtual stage of an interleaved (VPP) pipeline.

Compared after one step: every copy of every parameter's full gradient (TP shards joined,
each TP replica, every word-embedding copy under PP: the first stage's, each MTP stage's and,
tied, the loss stage's output weight; tests.harness.full_grads) against the one-process
run's, the main and MTP group norms, the loss and the per-depth MTP sums.
"""


import torch
from megatron.core import parallel_state

from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from tests.bodies.hybrid import slow_decay
from tests.harness import tiny_gpt
from tests.harness.full_grads import all_gather_distributed_optimizer_shards, gathered_full_grads, max_rel_to_reference
from tests.harness.layout import model_parallel
from tests.harness.tiny_gpt import Setup, build, train_step

WORD_EMBEDDING = "embedding.word_embeddings.weight"


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
            if setup.arch.startswith("delta_net"):
                # upstream's decay leaves a gradient the chunked kernel's float32 resolves to ~1e-5 only,
                # which the weights each setup happens to draw pass or fail (tests.bodies.hybrid.slow_decay)
                slow_decay(chunks[0].module)
            save_checkpoint(f"{ckpt_root}/{name}", chunks)
            out[name] = one_step(setup, chunks, optimizer, one_process=True)
            torch.save({n: copies[0] for n, copies in out[name].pop("grads").items()},
                       f"{ckpt_root}/{name}-grads.pt")
    return out


def pipeline_layout(layout: dict, mtp_num_layers: int) -> str | None:
    """The layout's upstream pipeline layout string, its "{m}" made the setup's D MTP layers."""
    template = layout.get("pipeline_layout")
    return None if template is None else template.replace("{m}", "m" * mtp_num_layers)


def build_on_layout(setup: Setup, text: str | None):
    """tiny_gpt.build, with the upstream pipeline layout (if any) in its TransformerConfig
    (tiny_gpt.build takes no layout: its config class is wrapped for the call)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if text is None:
        return build(setup, vpp)
    config_class = tiny_gpt.TransformerConfig
    tiny_gpt.TransformerConfig = lambda **kwargs: config_class(**kwargs, pipeline_model_parallel_layout=text)
    try:
        return build(setup, vpp)
    finally:
        tiny_gpt.TransformerConfig = config_class


def by_reference_name(grads: dict, tied: bool) -> dict:
    """Tied, a loss stage without the embedding holds the shared weight as its output
    layer's: one more copy of the word embedding."""
    if tied and "output_layer.weight" in grads:
        grads = dict(grads)
        grads[WORD_EMBEDDING] = grads[WORD_EMBEDDING] + grads.pop("output_layer.weight")
    return grads


def placement(chunks) -> str:
    """What each (virtual) stage of the built model holds, in upstream's layout notation
    (stages "|"-separated, virtual stage by virtual stage: E embedding, t decoder layer,
    m MTP depth, L loss), so a test sees which layout was really built."""
    mine = []
    for chunk in chunks:
        model = chunk.module
        mtp_depths = model.config.mtp_num_layers if getattr(model, "mtp_process", False) else 0
        mine.append("E" * model.pre_process + "t" * len(model.decoder.layers) + "m" * mtp_depths
                    + "L" * model.post_process)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (parallel_state.get_pipeline_model_parallel_rank(), mine))
    stages = dict(everyone)  # pipeline rank -> its virtual stages (the same on every TP and DP rank)
    assert len({len(v) for v in stages.values()}) == 1
    return "|".join(stages[pp][vp] for vp in range(len(chunks)) for pp in sorted(stages))


def layouts(ckpt_root: str, layouts: list[dict], setups: dict) -> dict:
    """Each layout with each of its setups (all by default). A layout may carry an upstream
    pipeline layout ("pipeline_layout", "{m}" for the MTP layers; its virtual stages follow
    from it; the parallel state is set up per setup, whose tying decides the embedding group)
    and a micro-batch size."""
    out = {}
    for layout in layouts:
        names = layout.get("setups", list(setups))
        if layout.get("pipeline_layout") is None:
            with model_parallel(tp=layout["tp"], pp=layout["pp"], vpp=layout.get("vpp"), cp=layout.get("cp", 1)):
                for name in names:
                    out[f"{layout['name']}/{name}"] = one_layout_step(ckpt_root, layout, name, setups[name])
        else:
            for name in names:
                setup = setups[name]
                # the library's word-embedding group: first stage, last when tied, every MTP stage
                with model_parallel(tp=layout["tp"], pp=layout["pp"],
                                    pipeline_layout=pipeline_layout(layout, setup["mtp_num_layers"]),
                                    tied_embeddings=setup.get("tied", False)):
                    out[f"{layout['name']}/{name}"] = one_layout_step(ckpt_root, layout, name, setup)
    return out


def one_layout_step(ckpt_root: str, layout: dict, name: str, setup_kwargs: dict) -> dict:
    kwargs = dict(setup_kwargs, distributed_optimizer=layout.get("distributed_optimizer", False))
    if "micro_batch" in layout:
        kwargs["micro_batch"] = layout["micro_batch"]
    setup = Setup(**kwargs)
    chunks, optimizer, _ = build_on_layout(setup, pipeline_layout(layout, setup.mtp_num_layers))
    load_checkpoint(f"{ckpt_root}/{name}", chunks)
    result = one_step(setup, chunks, optimizer)
    grads = by_reference_name(result.pop("grads"), setup.tied)
    result["grads_rel"] = max_rel_to_reference(grads, torch.load(f"{ckpt_root}/{name}-grads.pt"))
    result["copies"] = {n: len(copies) for n, copies in grads.items()}
    result["placement"] = placement(chunks)
    return result
