# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Isolation off: the fork's MTP forward (per-position logits and losses) equals upstream's.

`capture` runs in two processes on identical weights and data: one with this checkout's
patched megatron-core, one with pristine upstream of the same version plus only the
patches that make it run here (CPU/gloo, Python 3.11; they do not touch MTP). Both build
upstream's own local layer spec. Our side runs its dense MTP loss (every position, as
upstream) for the per-position comparison, then its default sparse loss, whose per-depth
masked CE sums are compared with upstream's per-position CE.
"""

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.harness.layout import model_parallel

VOCAB, SEQ = 48, 12


def _batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, VOCAB, (3, SEQ + 1), generator=g)
    mask = (torch.rand(3, SEQ, generator=g) > 0.3).float()
    mask[2, 4:] = 0.0
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def capture_cases(out_dir: str, side: str, cases: list) -> dict:
    """Each case is [depths, tied]; the "ours" side saves the weights the other side loads."""
    import megatron.core

    for depths, tied in cases:
        name = f"D{depths}-{'tied' if tied else 'untied'}"
        capture(f"{out_dir}/{side}-{name}.pt", f"{out_dir}/weights-{name}.pt", side == "ours", depths, tied)
    return {"core": megatron.core.__file__}


def capture(out_file: str, weights_file: str, ours: bool, depths: int, tied: bool) -> None:
    with model_parallel():
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=depths,
                                   mtp_loss_scaling_factor=0.3, hidden_dropout=0.0, attention_dropout=0.0,
                                   use_cpu_initialization=True, calculate_per_token_loss=True)
        spec = get_gpt_layer_local_spec()
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope", share_embeddings_and_output_weights=tied,
                         mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
        if ours:
            torch.save(model.state_dict(), weights_file)
            model.config.mtp_sparse_loss = False
        model.load_state_dict(torch.load(weights_file, weights_only=False))
        model.train()

        # Per-position CE of every loss the model computes (depths 1..D, then the main head),
        # before any masking or normalization: those differ between the two sides on purpose.
        cross_entropies, logits = [], []
        compute_loss = model.compute_language_model_loss

        def recording_loss(labels, logits_):
            loss = compute_loss(labels, logits_)
            cross_entropies.append(loss.detach().tolist())
            return loss

        model.compute_language_model_loss = recording_loss
        hook = model.output_layer.register_forward_hook(
            lambda m, a, out: logits.append(out[0].detach().transpose(0, 1).tolist()))
        main_first = []  # ours: whether the MTP branch computed the main head's logits (it reads p^k_t there)
        if ours:
            from megatron.core.fork.mtp import loss_branch as heads

            computed = heads.main_head_output

            def recording_head(*args, **kwargs):
                main_first.append(computed(*args, **kwargs))
                return main_first[-1]

            heads.main_head_output = recording_head
        # Upstream's loss tracker keeps a tensor sized for the first D it saw in this process.
        multi_token_prediction.MTPLossLoggingHelper.tracker.clear()
        input_ids, labels, mask = _batch()
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(input_ids)
        try:
            main = model(input_ids, positions, None, labels=labels, loss_mask=mask)
        finally:
            hook.remove()
            if ours:
                heads.main_head_output = computed
        if main_first and main_first[0] is not None:
            logits.append(logits.pop(0))  # upstream's order: the depths', then the main head's
        terms = cross_entropies[:depths]
        result = {"mtp_losses": terms, "logits": logits, "main": main.detach().tolist(), "mask": mask.tolist()}
        if ours:
            from megatron.core.fork.mtp.statistics import STEP_STATISTICS

            model.config.mtp_sparse_loss = True
            STEP_STATISTICS.reset()
            model(input_ids, positions, None, labels=labels, loss_mask=mask)
            result["sparse_ce_sums"] = STEP_STATISTICS.local_sums()[:, 0].tolist()
        torch.save(result, out_file)
