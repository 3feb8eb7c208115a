# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_foundation_training.py: the single-process reference and the parallel layouts."""

import torch
from megatron.core import parallel_state

from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from tests.harness.layout import model_parallel
from tests.harness.tiny_gpt import Setup, build, train_step

STEPS = 3


def _train(setup: Setup, chunks, optimizer, first_step: int, steps: int) -> list[dict]:
    return [train_step(setup, chunks, optimizer, step) for step in range(first_step, first_step + steps)]


def _flat_params(chunks) -> dict:
    return {f"{i}.{name}": p.detach().clone() for i, c in enumerate(chunks) for name, p in c.module.named_parameters()}


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()
    found = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            found.append(value.detach().clone())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    return found


def reference(ckpt_root: str) -> dict:
    """One process, whole batch. Saves each model's initial weights for the layouts to load."""
    results = {}
    with model_parallel():
        for mtp in (0, 2):
            setup = Setup(mtp_num_layers=mtp)
            chunks, optimizer, _ = build(setup)
            save_checkpoint(f"{ckpt_root}/init_mtp{mtp}", chunks)
            results[f"fp32_mtp{mtp}"] = _train(setup, chunks, optimizer, 0, STEPS)

        # bf16 mixed precision from the same initial weights as fp32.
        setup = Setup(mtp_num_layers=2, bf16=True)
        chunks, optimizer, _ = build(setup)
        load_checkpoint(f"{ckpt_root}/init_mtp2", chunks)
        results["bf16_mtp2"] = _train(setup, chunks, optimizer, 0, STEPS)

        results["resume"] = resume_exactly(ckpt_root)
        results["isolation_is_not_a_shape"] = isolation_is_not_a_shape(ckpt_root)
        results["shape_mismatch"] = shape_mismatch_is_refused(ckpt_root)
    return results


def isolation_is_not_a_shape(ckpt_root: str) -> dict:
    """Model and optimizer state saved with isolation on (or off) load bit-exactly with it
    on and off (spec section 9), for 1 and 2 depths, after a step (optimizer state exists)."""
    out = {}
    for depths in (1, 2):
        for saved_detached in (True, False):
            saved_setup = Setup(mtp_num_layers=depths, mtp_detach_heads=saved_detached)
            chunks, optimizer, _ = build(saved_setup)
            _train(saved_setup, chunks, optimizer, 0, 1)
            path = f"{ckpt_root}/iso_D{depths}_{int(saved_detached)}"
            save_checkpoint(path, chunks, optimizer)
            params, optimizer_state = _flat_params(chunks), _optimizer_tensors(optimizer)
            for load_detached in (True, False):
                torch.manual_seed(1000 + depths)
                load_setup = Setup(mtp_num_layers=depths, mtp_detach_heads=load_detached)
                fresh, fresh_optimizer, _ = build(load_setup)
                load_checkpoint(path, fresh, fresh_optimizer)
                loaded = _flat_params(fresh)
                loaded_optimizer = _optimizer_tensors(fresh_optimizer)
                _train(load_setup, fresh, fresh_optimizer, 1, 1)  # and trains on
                out[f"D{depths}/saved{int(saved_detached)}/loaded{int(load_detached)}"] = (
                    sorted(loaded) == sorted(params)
                    and all(torch.equal(loaded[k], params[k]) for k in params)
                    and len(loaded_optimizer) == len(optimizer_state) > 0
                    and all(torch.equal(a, b) for a, b in zip(loaded_optimizer, optimizer_state))
                )
    return out


def shape_mismatch_is_refused(ckpt_root: str) -> dict:
    """A checkpoint of 2 distinct, untied MTP depths, loaded into other shapes: refused before
    any tensor is read, naming each difference."""
    saved = Setup(mtp_num_layers=2)
    chunks, optimizer, _ = build(saved)
    save_checkpoint(f"{ckpt_root}/shape", chunks, optimizer)
    out = {}
    for name, kwargs in {"depths": dict(mtp_num_layers=1),
                         "repeated": dict(mtp_num_layers=2, mtp_use_repeated_layer=True),
                         "tied": dict(mtp_num_layers=2, tied=True), "no_mtp": dict(mtp_num_layers=0),
                         "hidden": dict(mtp_num_layers=2, hidden_size=64)}.items():
        torch.manual_seed(5)
        other, other_optimizer, _ = build(Setup(**kwargs))
        before = _flat_params(other)
        try:
            load_checkpoint(f"{ckpt_root}/shape", other, other_optimizer)
            message = None
        except ValueError as error:
            message = str(error)
        after = _flat_params(other)
        out[name] = {"message": message, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    return out


def resume_exactly(ckpt_root: str) -> dict:
    """Train 2 steps, save model + optimizer, train 2 more; a fresh model loading the
    checkpoint must hold identical parameters and optimizer state and repeat those 2 steps."""
    setup = Setup(mtp_num_layers=2)
    chunks, optimizer, _ = build(setup)
    _train(setup, chunks, optimizer, 0, 2)
    save_checkpoint(f"{ckpt_root}/resume", chunks, optimizer)
    saved_params, saved_optimizer = _flat_params(chunks), _optimizer_tensors(optimizer)
    continued = _train(setup, chunks, optimizer, 2, 2)

    torch.manual_seed(999)  # a different initialization, so the load has to do the work
    fresh_chunks, fresh_optimizer, _ = build(setup)
    load_checkpoint(f"{ckpt_root}/resume", fresh_chunks, fresh_optimizer)
    loaded_params, loaded_optimizer = _flat_params(fresh_chunks), _optimizer_tensors(fresh_optimizer)
    resumed = _train(setup, fresh_chunks, fresh_optimizer, 2, 2)
    return {
        "param_names_match": sorted(saved_params) == sorted(loaded_params),
        "param_max_diff": max((saved_params[k] - loaded_params[k]).abs().max().item() for k in saved_params),
        "optimizer_tensor_count": [len(saved_optimizer), len(loaded_optimizer)],
        "optimizer_max_diff": max(
            ((a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
            for a, b in zip(saved_optimizer, loaded_optimizer)
        ),
        "continued": continued,
        "resumed": resumed,
    }


def layouts(ckpt_root: str, cases: list[dict]) -> dict:
    """Each case: tp, pp, vpp, mtp, distributed_optimizer, micro_batch; loads the reference's
    initial weights. (The reference's micro-batch size differs: the step is exact however cut.)"""
    results = {}
    for case in cases:
        with model_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp")):
            setup = Setup(mtp_num_layers=case["mtp"], distributed_optimizer=case.get("distributed_optimizer", False),
                          micro_batch=case.get("micro_batch", Setup.micro_batch))
            chunks, optimizer, _ = build(setup, vpp=case.get("vpp"))
            load_checkpoint(f"{ckpt_root}/init_mtp{case['mtp']}", chunks)
            results[case["name"]] = {
                "dp": parallel_state.get_data_parallel_world_size(),
                "steps": _train(setup, chunks, optimizer, 0, STEPS),
            }
    return results


def sdpa_matches_upstream_attention() -> dict:
    """SDPACoreAttention against upstream's local DotProductAttention on the same weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.fork.runtime.specs import on_this_device

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               transformer_impl="local")
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(16).unsqueeze(0).expand(3, -1)
    causal = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    padded = causal.repeat(3, 1, 1, 1)
    padded[1, :, :, 10:] = True  # sample 1: keys 10.. are padding
    padded[1, :, :, 0] = False
    out = {}
    with model_parallel():
        models = []
        sdpa = get_gpt_layer_local_spec()
        on_this_device(config, sdpa)  # upstream's local spec, its DotProductAttention swapped
        for spec in (get_gpt_layer_local_spec(), sdpa):
            torch.manual_seed(11)
            models.append(GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,
                                   max_sequence_length=16))
        for name, mask in (("causal", causal), ("padding", padded)):
            local, sdpa = (m(tokens, positions, mask) for m in models)
            out[name] = (local - sdpa).abs().max().item()
    return out


LEARN_STEPS = 4


def learns() -> dict:
    """The step's lm loss over LEARN_STEPS steps on one repeated batch (the data batches are
    uniform random tokens, so only a seen batch can get easier), with the reference's
    learning rate and, as the control a non-learning model gives, with lr 0."""
    out = {}
    with model_parallel():
        for name, lr in (("trained", Setup.lr), ("lr0", 0.0)):
            for mtp in (0, 2):
                torch.manual_seed(21)
                setup = Setup(mtp_num_layers=mtp, lr=lr)
                chunks, optimizer, _ = build(setup)
                out[f"{name}_mtp{mtp}"] = [train_step(setup, chunks, optimizer, 0) for _ in range(LEARN_STEPS)]
    return out


def reference_suite(ckpt_root: str) -> dict:
    return {"reference": reference(ckpt_root), "sdpa": sdpa_matches_upstream_attention(), "learns": learns()}
