# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies for tests/test_verl_engine.py: verl 0.9.1's own Megatron engine step, run by .venv-verl's
interpreter (tools/bootstrap --framework verl), with the verl series applied, or with it applied
except its step patch (verl's own MTP normalization: `first_on_path`).

The engine is verl's MegatronEngineWithLMHead, set up as its `initialize()` sets it up except for the
model's builder: verl builds through mbridge or Megatron-Bridge, which need Transformer Engine, so the
model here is megatron-core's GPTModel on the local spec (megatron_mtp.library.build_model), from a
TransformerConfig with verl's own MTP overrides (check_mtp_config) and the engine config's parallel
sizes. Then verl's own patch_engine_mtp, its optimizer (init_megatron_optim_config,
get_megatron_optimizer) and register_megatron_training_hooks; the step is verl's train_batch
(optimizer_zero_grad, forward_backward_batch, optimizer_step) with verl's sft_loss.

The data is verl's: a mini-batch of packed (nested) sequences of several lengths per data-parallel
rank, with full-length loss masks as verl's SFT data has them (1 where a token is a target), holes in
them, a sequence whose first next-token target counts (the model's mask starts at position 0), one
with no target, and uneven valid tokens per rank. The reference (tests/reference/gpt_mtp.py) takes the
whole global batch packed in one row: verl's main loss (sft_loss: the token mean over the global
batch) plus the spec's (lambda / D) sum_k S_k / N_tok.
"""

import types
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mtp.library.checkpointing import load_checkpoint, save_checkpoint
from megatron_mtp.library.model import build_model
from tests.harness.full_grads import gathered_full_grads, max_rel_to_reference
from tests.harness.layout import model_parallel
from tests.reference.gpt_mtp import ReferenceGPT, mtp_inner_layer_name

VOCAB, HIDDEN, HEADS, GROUPS, LAYERS = 48, 32, 4, 2, 2
LAMBDA = 0.3
# the global mini-batch: (length, the positions whose token is a target), sequences 0-3 on data-parallel
# rank 0 and 4-7 on rank 1 (of two); holes in most; sequence 1's first next-token target (token 1)
# counts; sequence 6 has none
SEQUENCES = [(9, range(4, 9)), (13, [1, 2, 3, 7, 8, 9, 12]), (6, [3, 5]), (11, range(2, 11)),
             (12, [5, 6, 7, 8, 10, 11]), (7, range(1, 7)), (10, []), (8, [2, 3, 4, 6, 7])]


def global_batch():
    """[(tokens [L], loss mask [L])] of the whole mini-batch."""
    g = torch.Generator().manual_seed(7)
    batch = []
    for length, targets in SEQUENCES:
        mask = torch.zeros(length)
        mask[list(targets)] = 1.0
        batch.append((torch.randint(1, VOCAB, (length,), generator=g), mask))
    return batch


def rank_share(batch):
    """This data-parallel rank's sequences: an equal number each, in rank order."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = len(batch) // dp
    return batch[rank * per_rank:(rank + 1) * per_rank]


def tensordict(share, micro_batch: int, logged: bool = False):
    """verl's mini-batch as its engine takes it (nested input_ids and loss_mask, no padding); `logged`:
    the mini-batch that ends one of verl's training steps (its update_lr_scheduler), whose metrics verl
    logs."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    nested = partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    data = TensorDict({"input_ids": nested([tokens for tokens, _ in share]),
                       "loss_mask": nested([mask for _, mask in share]),
                       "temperature": torch.ones(len(share))}, batch_size=[len(share)])
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch, global_token_num=[
        len(tokens) for tokens, _ in share], update_lr_scheduler=logged)
    return data


def engine_configs(case: dict):
    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.model import MtpConfig

    engine_config = McoreEngineConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        use_remove_padding=case["format"] == "thd", use_distributed_optimizer=False, use_dynamic_bsz=False,
        micro_batch_size_per_gpu=case["micro_batch"])
    mtp = MtpConfig(enable=True, enable_train=True, detach_encoder=case["detach_encoder"],
                    mtp_loss_scaling_factor=LAMBDA)
    hf_config = types.SimpleNamespace(architectures=["Qwen3ForCausalLM"], num_nextn_predict_layers=case["depths"])
    model_config = types.SimpleNamespace(mtp=mtp, hf_config=hf_config, model_type="language_model",
                                         tokenizer=types.SimpleNamespace(pad_token_id=0),
                                         share_embeddings_and_output_weights=False)
    optimizer_config = McoreOptimizerConfig(lr=1e-3, clip_grad=1e9, weight_decay=0.0)
    return engine_config, model_config, optimizer_config


def transformer_config(engine_config, case: dict) -> TransformerConfig:
    """What verl's bridge would give (its model sizes, the engine's parallel sizes, verl's MTP overrides
    from check_mtp_config), on the local spec in float32."""
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        mtp_num_layers=case["depths"], hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=engine_config.tensor_model_parallel_size,
        pipeline_model_parallel_size=engine_config.pipeline_model_parallel_size,
        sequence_parallel=engine_config.sequence_parallel, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # verl's provider override, which variable lengths need
        calculate_per_token_loss=case["per_token"], **engine_config.override_transformer_config)


def _right_padding_is_causal(model, args, kwargs):
    """verl's BSHD forward passes a [b, s] mask, True at a row's tokens, False at its right padding.
    Causal attention never reads past a row's last token, so without the mask every token's output is
    the same; the local spec's attention (megatron-core's, and the fork's SDPA on CPU) would read it as
    [b, 1, s, s] with True marking excluded positions: the stand-in model takes no padding mask."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        kwargs["attention_mask"] = None
    return args, kwargs


def make_engine(case: dict, checkpoint: str | None):
    """verl's engine with the model built here; `checkpoint`: its weights (None: fresh, to save)."""
    from verl.utils.megatron_utils import check_mtp_config, patch_engine_mtp
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine_config, model_config, optimizer_config = engine_configs(case)
    engine = MegatronEngineWithLMHead(model_config, engine_config, optimizer_config, checkpoint_config=None)
    check_mtp_config(model_config, engine_config)  # _build_tf_config's MTP overrides
    config = transformer_config(engine_config, case)
    engine.tf_config, engine.param_dtype, engine.is_value_model = config, torch.float32, False
    torch.manual_seed(5)
    engine.module = build_model(config, VOCAB, 64)
    for chunk in engine.module:
        chunk.module.register_forward_pre_hook(_right_padding_is_causal, with_kwargs=True)
    if checkpoint is not None:
        load_checkpoint(checkpoint, engine.module)
    patch_engine_mtp(engine.module, model_config)  # initialize()'s MTP patches
    engine.optimizer = engine._build_optimizer()  # verl's optimizer and register_megatron_training_hooks
    return engine


def step(engine, data):
    """verl's train_batch with sft_loss: every copy of every full gradient as forward_backward_batch left
    it (captured as optimizer_step begins), whether the optimizer step changed the weights, and verl's
    MTP metrics (on the ranks that report them; {} elsewhere)."""
    from verl.workers.utils.losses import sft_loss

    captured = {}
    optimizer_step = engine.optimizer_step
    before = [p.detach().clone() for chunk in engine.module for p in chunk.parameters()]

    def capturing():
        captured["full"] = gathered_full_grads(engine.module)
        return optimizer_step()

    engine.optimizer_step = capturing
    output = engine.train_batch(data, partial(sft_loss, None))
    after = [p.detach() for chunk in engine.module for p in chunk.parameters()]
    moved = any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    metrics = (output or {}).get("metrics", {})
    return captured["full"], moved, {k: [float(x) for x in v] for k, v in metrics.items() if k.startswith("mtp")}


def reference(state: dict, batch, case: dict) -> tuple:
    """verl's main loss on the whole global batch plus the spec's MTP term, one packed row: (gradients,
    each depth's loss S_k / M_k)."""
    ref = ReferenceGPT(VOCAB, HIDDEN, HEADS, LAYERS, case["depths"], groups=GROUPS, tied=False,
                       detach_heads=case["detach_encoder"], mtp_loss_scaling_factor=LAMBDA,
                       mtp_inner_name=mtp_inner_layer_name(state))
    ref.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")})
    tokens = torch.cat([t for t, _ in batch]).unsqueeze(0)
    segments = torch.cat([torch.full((len(t),), i) for i, (t, _) in enumerate(batch)]).unsqueeze(0)
    # the target at t is token t + 1 of the same sequence, counted where the loss mask marks that token
    labels = torch.cat([torch.cat([t[1:], t.new_zeros(1)]) for t, _ in batch]).unsqueeze(0)
    mask = torch.cat([torch.cat([m[1:], m.new_zeros(1)]) for _, m in batch]).unsqueeze(0)
    (ref.objective_sums(tokens, labels, mask, segments) / mask.sum()).backward()
    with torch.no_grad():
        _, _, per_depth = ref.losses(tokens, labels, mask, segments)
    losses = [float((ce * mask_k).sum() / mask_k.sum()) for ce, mask_k, _, _ in per_depth]
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}, losses


def initial_state(case: dict, ckpt_root: str) -> tuple:
    """The initial weights of `case`'s model (a checkpoint per depth count and isolation, saved on one
    rank's layout) and their state dict."""
    name = f"{ckpt_root}/init_d{case['depths']}_{int(case['detach_encoder'])}"
    with model_parallel():
        engine = make_engine(case, None)
        save_checkpoint(name, engine.module)
        state = {k: v.clone() for k, v in engine.module[0].module.state_dict().items() if v is not None}
    return name, state


def run_layouts(ckpt_root: str, cases: list, layouts: list, pairs: list) -> dict:
    """Each layout (name, TP, PP) x case: the worst deviation of any gradient from the reference, the
    optimizer step, verl's MTP metrics and the reference's per-depth losses; for each pair of cases (the
    same mini-batch cut otherwise) the worst deviation of one's gradients from the other's."""
    batch = global_batch()
    out, states = {}, {}
    for layout, tp, pp in layouts:
        grads = {}
        for case in cases:
            key = (case["depths"], case["detach_encoder"])
            if key not in states:
                states[key] = initial_state(case, ckpt_root)
            checkpoint, state = states[key]
            want, losses = reference(state, batch, case)
            with model_parallel(tp=tp, pp=pp):
                engine = make_engine(case, checkpoint)
                data = tensordict(rank_share(batch), case["micro_batch"], logged=case.get("logged", False))
                grads[case["name"]], moved, metrics = step(engine, data)
            out[f"{layout}/{case['name']}"] = {"rel": max_rel_to_reference(grads[case["name"]], want),
                                               "moved": moved, "metrics": metrics, "reference losses": losses}
        for a, b in pairs:
            out[f"{layout}/{a}~{b}"] = max_rel_to_reference(grads[a], {n: g[0] for n, g in grads[b].items()})
    return out


def first_token_target(ckpt_root: str, case: dict) -> dict:
    """A mini-batch where one sequence on data-parallel rank 1 counts its first token as a target: the
    refusal's message on every rank, and whether the step left the weights and gradients as they were."""
    batch = global_batch()
    batch[-1][1][0] = 1.0
    checkpoint, _ = initial_state(case, ckpt_root)
    with model_parallel():
        engine = make_engine(case, checkpoint)
        before = [p.detach().clone() for chunk in engine.module for p in chunk.parameters()]
        try:
            step(engine, tensordict(rank_share(batch), case["micro_batch"]))
            message = None
        except ValueError as refusal:
            message = str(refusal)
        params = all(torch.equal(b, p) for b, p in zip(
            before, [p for chunk in engine.module for p in chunk.parameters()], strict=True))
        grads = all(float(p.main_grad.abs().max()) == 0.0 for chunk in engine.module for p in chunk.parameters())
    return {"message": message, "params": params, "grads_zero": grads}


def contradicting_override() -> str | None:
    """check_mtp_config with mtp_detach_heads overridden against detach_encoder: its one-line refusal."""
    from verl.utils.megatron_utils import check_mtp_config

    case = {"format": "thd", "micro_batch": 1, "detach_encoder": False, "depths": 1}
    with model_parallel():
        engine_config, model_config, _ = engine_configs(case)
    engine_config.override_transformer_config["mtp_detach_heads"] = True
    try:
        check_mtp_config(model_config, engine_config)
    except ValueError as refusal:
        return str(refusal)
    return None


def suite(ckpt_root: str, cases: list, layouts: list, pairs: list, refusals: bool = False) -> dict:
    out = {"layouts": run_layouts(ckpt_root, cases, layouts, pairs)}
    if refusals:
        out["first token target"] = first_token_target(ckpt_root, cases[0])
        out["contradicting override"] = contradicting_override()
    return out
