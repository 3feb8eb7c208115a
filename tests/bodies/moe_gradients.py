# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""MoE + MTP gradients after one exact step against the plain-PyTorch reference
(tests/reference/moe.py), on one process and on DP / EP / EP x TP (sequence parallel) / PP / CP layouts.

`reference` (one process) builds each setup, gives its routers a random expert bias, saves the
weights, computes the reference's gradients of the spec's step objective (section 4 plus the
router losses of section 11) on the whole global batch and its expert-bias update, then runs one
megatron step on one rank and compares. `layouts` (4 ranks) loads the same weights on each layout
and compares every copy of every full gradient (experts gathered across EP, shards across TP and
ETP) with the reference's and with the one-rank megatron run's, and every copy of every expert bias
after the step with the reference's update. A hybrid setup's gradients are compared under the
model's names (its mixer and MLP layers are the halves of a reference layer:
tests.bodies.hybrid.reference_name), its Gated DeltaNet's decay slowed first
(tests.bodies.hybrid.slow_decay).
"""

import torch

from megatron.core.fork.mtp import router_losses
from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from tests.bodies.hybrid import reference_name, slow_decay
from tests.harness.layout import model_parallel
from tests.harness.moe_full_grads import gathered_full_grads_and_buffers
from tests.harness.tiny_gpt import (
    Setup,
    build,
    drop_moe_metrics_tracker,
    global_batch,
    reference_architecture,
    train_step,
)
from tests.reference.gpt_mtp import mtp_inner_layer_name
from tests.reference.moe import ReferenceMoEGPT, balance_loss, moe_layer_pattern

MOE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
              "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
              "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
              "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "add_bias_linear", "swiglu")


def uses_aux_loss(kwargs: dict) -> bool:
    kinds = kwargs.get("moe_router_load_balancing_type", "aux_loss")
    return ("aux_loss" in (kinds if isinstance(kinds, (list, tuple)) else [kinds])
            and bool(kwargs.get("moe_aux_loss_coeff")))


def fresh_build(setup: Setup):
    """build(), with upstream's global MoE metrics tracker dropped first: the library's step
    never reports (clears) it, and its per-layer entries keep the size of the first model that
    recorded, so a model with more MoE layers in the same process fails with an IndexError."""
    drop_moe_metrics_tracker()
    return build(setup)


def one_step(setup: Setup, chunks, optimizer, config, step=None) -> dict:
    """One trainer step (`step()`, default: train_step on the setup's global batch); full
    gradients and expert biases captured after finalize (which updates the biases), before the
    optimizer clips and steps."""
    captured = {}
    original_step = optimizer.step

    def step_after_capture():
        captured["grads"], captured["bias"] = gathered_full_grads_and_buffers(chunks, config)
        return original_step()

    optimizer.step = step_after_capture
    try:
        result = step() if step else train_step(setup, chunks, optimizer, 0)
    finally:
        optimizer.step = original_step
    return {"metrics": {k: v for k, v in result.items() if isinstance(v, (int, float))}, **captured}


def compare(full: dict, reference: dict) -> dict:
    """Worst deviation of any copy relative to the reference's largest magnitude, per parameter;
    names missing or extra, and how many copies were compared."""
    missing, extra = sorted(set(reference) - set(full)), sorted(set(full) - set(reference))
    per_param, copies = {}, 0
    for name, want in reference.items():
        worst = 0.0
        for got in full.get(name, []):
            copies += 1
            if got.shape != want.shape:
                worst = float("inf")
                break
            error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
            worst = max(worst, error if error == error else float("inf"))
        per_param[name] = worst
    worst_name = max(per_param, key=per_param.get) if per_param else None
    return {"max_rel": per_param[worst_name] if worst_name else float("inf"), "worst": worst_name,
            "missing": missing, "extra": extra, "copies": copies,
            "mtp_router_max_rel": max([v for n, v in per_param.items() if n.startswith("mtp.") and ".router." in n],
                                      default=0.0),
            "non_mtp_max_rel": max([v for n, v in per_param.items() if not n.startswith("mtp.")], default=0.0)}


def compare_bias(bias: dict, reference: dict) -> dict:
    missing = sorted(set(reference) - set(bias))
    worst = max((float((got - reference[n]).abs().max()) for n in reference for got in bias.get(n, [])), default=0.0)
    return {"max_abs": worst, "missing": missing, "copies": sum(len(bias.get(n, [])) for n in reference)}


def reference_model(setup: Setup, chunks, config) -> tuple[ReferenceMoEGPT, dict]:
    """The reference on the model's weights, and the model's name of each of its parameters and
    buffers (a hybrid model's mixer and MLP layers are the halves of a reference layer)."""
    state = {k: v for k, v in chunks[0].module.state_dict().items()
             if not k.endswith("_extra_state") and not k.endswith("local_tokens_per_expert")}
    names = {k: reference_name(k) if setup.hybrid else k for k in state}
    options = {f: getattr(setup, f) for f in MOE_FIELDS}
    options["moe_ffn_hidden_size"] = config.moe_ffn_hidden_size
    ref = ReferenceMoEGPT(setup.vocab_size, setup.hidden_size, setup.num_heads, setup.num_layers,
                          setup.mtp_num_layers, options, ffn=config.ffn_hidden_size, tied=setup.tied,
                          repeated=setup.mtp_use_repeated_layer, detach_heads=setup.mtp_detach_heads,
                          mtp_loss_scaling_factor=config.mtp_loss_scaling_factor,
                          mtp_inner_name=mtp_inner_layer_name(state), arch=reference_architecture(setup),
                          mtp_loss_type=setup.mtp_loss_type, mtp_draft_temperature=setup.mtp_draft_temperature)
    ref.load_state_dict({names[k]: v for k, v in state.items()}, strict=True)
    return ref, {v: k for k, v in names.items()}


def reference_grads(ref: ReferenceMoEGPT, model_names: dict, setup: Setup, micro_batch: int):
    """The reference's gradient of the step objective and its expert-bias update (by the model's
    names), and its terms."""
    tokens, mask = global_batch(setup, 0)
    ref.zero_grad(set_to_none=True)
    objective, terms = ref.step_objective(tokens, mask, micro_batch)
    objective.backward()
    grads = {model_names[n]: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in ref.named_parameters()}
    bias = {model_names[n]: value for n, value in ref.updated_expert_bias().items()}
    return grads, bias, {k: float(v) for k, v in terms.items()}


def depth_router_losses(ref: ReferenceMoEGPT, setup: Setup, micro_batch: int) -> dict:
    """Each MTP depth's z-loss (token mean) and sequence-wise balance loss (sequence mean) of
    the reference's last step_objective, named as the step reports them; {} when the MTP
    layer is dense. The MTP depths' calls are the last D router entries."""
    o = ref.options
    depths = setup.mtp_num_layers
    if not depths or not moe_layer_pattern(o.get("moe_layer_freq", 1), setup.num_layers)[-1]:
        return {}
    values = {}
    for k, e in enumerate(ref.router_entries[-depths:], start=1):
        if o.get("moe_z_loss_coeff"):
            values[f"mtp_{k} z loss"] = float(e["z"].mean())
        b, experts = e["p"].size(0), e["p"].size(-1)
        balancing = o.get("moe_router_load_balancing_type") if o.get("moe_aux_loss_coeff") else None
        if balancing == "seq_aux_loss":
            values[f"mtp_{k} seq load balancing loss"] = float(
                sum(balance_loss(e["p"][q], e["chosen"][q], o["moe_router_topk"]) for q in range(b)) / b)
        if balancing == "aux_loss":  # token-weighted over micro-batches
            groups = [slice(start, start + micro_batch) for start in range(0, b, micro_batch)]
            values[f"mtp_{k} load balancing loss"] = float(sum(
                balance_loss(e["p"][g].reshape(-1, experts), e["chosen"][g].reshape(-1, experts),
                             o["moe_router_topk"]) for g in groups) / len(groups))
    return values


def broken_scale(mode: str, setup: Setup):
    """A wrong router-loss denominator (to see the comparison fail): the loss scale alone, or
    over the step's valid targets instead of its routed tokens."""
    original = router_losses.scale_func
    valid = int(global_batch(setup, 0)[1].sum())

    def scale_func(config, routed_tokens, grad_scale_func=None):
        right = original(config, routed_tokens, grad_scale_func)
        factor = {"no_division": routed_tokens, "valid_tokens": routed_tokens / valid}[mode]
        return lambda: right() * factor

    return scale_func


def reference(ckpt_root: str, setups: dict, breaks: list | None = None) -> dict:
    out = {}
    with model_parallel():
        for name, kwargs in setups.items():
            setup = Setup(**kwargs)
            torch.manual_seed(11)
            chunks, optimizer, config = fresh_build(setup)
            gen = torch.Generator().manual_seed(5)
            for module in chunks[0].module.modules():
                if getattr(module, "expert_bias", None) is not None:  # a bias that changes the routing
                    module.expert_bias.copy_(0.05 * torch.randn(module.expert_bias.shape, generator=gen))
            if setup.arch == "delta_net":
                slow_decay(chunks[0].module)  # (tests.bodies.hybrid: a decay whose gradient the kernel resolves)
            save_checkpoint(f"{ckpt_root}/{name}", chunks)
            ref, model_names = reference_model(setup, chunks, config)
            for mb in ((1, 2) if uses_aux_loss(kwargs) else (setup.micro_batch,)):
                grads, bias, terms = reference_grads(ref, model_names, setup, mb)
                depth_losses = depth_router_losses(ref, setup, mb)
                torch.save({"grads": grads, "bias": bias, "depth_router_losses": depth_losses},
                           f"{ckpt_root}/{name}-mb{mb}-reference.pt")
                if mb == setup.micro_batch:
                    want_grads, want_bias, out_terms, want_depths = grads, bias, terms, depth_losses
            got = one_step(setup, chunks, optimizer, config)
            torch.save({"grads": got["grads"]}, f"{ckpt_root}/{name}-one-rank.pt")
            out[name] = {"grads": compare(got["grads"], want_grads), "bias": compare_bias(got["bias"], want_bias),
                         "terms": out_terms, "metrics": got["metrics"], "depth_router_losses": want_depths}
        for name, mode in breaks or []:
            setup = Setup(**setups[name])
            chunks, optimizer, config = fresh_build(setup)
            load_checkpoint(f"{ckpt_root}/{name}", chunks)
            want = torch.load(f"{ckpt_root}/{name}-mb{setup.micro_batch}-reference.pt")
            original = router_losses.scale_func
            router_losses.scale_func = broken_scale(mode, setup)
            try:
                got = one_step(setup, chunks, optimizer, config)
            finally:
                router_losses.scale_func = original
            out[f"broken-{mode}/{name}"] = {"grads": compare(got["grads"], want["grads"])}
    return out


def layouts(ckpt_root: str, layouts: list, setups: dict) -> dict:
    """Each layout (TP, PP, EP, CP: "cp", default 1) with its setups ("setups", default all)."""
    out = {}
    for layout in layouts:
        with model_parallel(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], cp=layout.get("cp", 1)):
            for name in layout.get("setups", list(setups)):
                kwargs = setups[name]
                setup = Setup(**{**kwargs, **layout.get("setup", {})})
                chunks, optimizer, config = fresh_build(setup)
                load_checkpoint(f"{ckpt_root}/{name}", chunks)
                mb = setup.micro_batch if uses_aux_loss(kwargs) else Setup(**kwargs).micro_batch
                want = torch.load(f"{ckpt_root}/{name}-mb{mb}-reference.pt")
                got = one_step(setup, chunks, optimizer, config)
                one_rank = torch.load(f"{ckpt_root}/{name}-one-rank.pt")["grads"]
                out[f"{layout['name']}/{name}"] = {
                    "grads": compare(got["grads"], want["grads"]),
                    "bias": compare_bias(got["bias"], want["bias"]),
                    "vs_one_rank": compare(got["grads"], {n: copies[0] for n, copies in one_rank.items()}),
                    "micro_batch": setup.micro_batch,
                    "metrics": got["metrics"],
                    "depth_router_losses": want["depth_router_losses"],
                }
    return out


def streaming_refusal(setup_kwargs: dict) -> dict:
    """A split step without counts up front, with router losses: refused in one line at begin,
    the weights and optimizer untouched. (It was not refused: the step's division of every backbone
    gradient by the main count after the reduce took the routers' terms, normalized by T already,
    0.87-0.99 off in relative terms.)"""
    from megatron_mtp.library.batches import rank_microbatches
    from megatron_mtp.library.step import train_step as library_step

    with model_parallel():
        setup = Setup(**setup_kwargs)
        chunks, optimizer, _ = fresh_build(setup)
        before = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
        tokens, mask = global_batch(setup, 0)
        try:
            library_step(chunks, optimizer, rank_microbatches(tokens, mask, setup.micro_batch), setup.seq_length,
                         "token", counts_up_front=False)
            message = None
        except ValueError as error:
            message = str(error)
        unchanged = all(torch.equal(p, before[n]) for n, p in chunks[0].module.named_parameters())
        return {"message": message, "unchanged": unchanged}
