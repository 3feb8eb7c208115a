# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The first step of a pretrain_gpt_mtp.py run, recomputed without megatron-core's model.

The samples are read back the way megatron-core's GPTDataset defines them (its shuffle,
sample and document indices, cached beside the data by the run), the weights from the
run's starting checkpoint, and the spec's objective is evaluated on the plain-PyTorch
reference model (tests/reference/gpt_mtp.py): losses, per-depth MTP losses and the
gradient norms of the main and MTP parameter groups.
"""

import json
from pathlib import Path

import numpy
import torch

from tests.reference.gpt_mtp import ReferenceGPT, draft_objective_sum, draft_terms

# Local-spec names in megatron-core's checkpoints (layer norms fused into the linear that
# follows them, as Transformer Engine names them) -> the reference's module names.
RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def _rename(name: str) -> str:
    for old, new in RENAMES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def reference_weights(tensors: dict) -> dict:
    """A torch_dist checkpoint's model tensors (decoder layers stacked) as a state dict."""
    state = {}
    for key, value in tensors.items():
        if key.startswith("optimizer") or "_extra_state" in key or key.startswith(("rng_state", "rerun")):
            continue
        if key.startswith("decoder.layers."):
            suffix = key[len("decoder.layers."):]
            for layer, weight in enumerate(value):
                state[_rename(f"decoder.layers.{layer}.{suffix}")] = weight.clone()
        else:
            state[_rename(key)] = value.clone()
    return state


def gpt_train_samples(prefix: Path, num_samples: int, count: int) -> torch.Tensor:
    """The first `count` training samples [count, S + 1] of a GPTDataset of `num_samples`."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cache = Path(prefix) / "cache" / "GPTDataset_indices"  # megatron-core caches beside the data
    matches = [d for d in cache.glob("*-GPTDataset-train-description.txt")
               if json.loads(d.read_text())["num_samples"] == num_samples]
    assert len(matches) == 1, (cache, [d.name for d in cache.iterdir()])
    stem = str(matches[0])[: -len("description.txt")]
    shuffle = numpy.load(stem + "shuffle_index.npy")
    sample_index = numpy.load(stem + "sample_index.npy")
    document_index = numpy.load(stem + "document_index.npy")
    documents = IndexedDataset(str(prefix))
    samples = []
    for position in range(count):
        i = shuffle[position]
        (first, first_offset), (last, last_offset) = sample_index[i], sample_index[i + 1]
        parts = []
        for j in range(first, last + 1):
            tokens = documents[int(document_index[j])]
            start = first_offset if j == first else 0
            stop = last_offset + 1 if j == last else len(tokens)  # +1: the extra target token
            parts.append(tokens[start:stop])
        samples.append(torch.from_numpy(numpy.concatenate(parts).astype(numpy.int64)))
    return torch.stack(samples)


def first_step(weights: dict, samples: torch.Tensor, eod_id: int, *, depths: int, level: str, detach: bool,
               mtp_loss_scaling_factor: float = 0.1, objective: str = "ce", temperature: float = 1.0) -> dict:
    """The spec's objective of one global batch: the metrics a run logs for that step
    (`objective`, `temperature`: the MTP draft objective of spec section 12)."""
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("decoder.layers."))
    vocab, hidden = weights["embedding.word_embeddings.weight"].shape
    heads = 4  # tests.harness.trainer.TINY
    model = ReferenceGPT(vocab, hidden, heads, layers, depths, tied="output_layer.weight" not in weights,
                         detach_heads=detach, mtp_loss_scaling_factor=mtp_loss_scaling_factor)
    model.load_state_dict(weights)
    model.double()  # the reference's own rounding far below the float32 run's
    inputs, labels = samples[:, :-1], samples[:, 1:]
    # --eod-mask-loss as megatron-core defines it: no target where the input is an end of
    # document (the first token of the next document is not predicted from the previous one).
    mask = (inputs != eod_id).float()
    logits, main, per_depth = model.losses(inputs, labels, mask)
    tokens = mask.sum()
    if level == "token":
        loss = (main * mask).sum() / tokens
    else:
        per_sequence = mask.sum(dim=1)
        valid = per_sequence > 0
        loss = ((main * mask).sum(dim=1)[valid] / per_sequence[valid]).mean()
    metrics = {"lm loss": loss.item()}
    terms = draft_terms(objective, logits, per_depth, None, temperature)
    for k, (term, (_, mask_k, _, _)) in enumerate(zip(terms, per_depth, strict=True), start=1):
        metrics[f"mtp_{k} loss"] = ((term * mask_k).sum() / mask_k.sum()).item()
    mtp = draft_objective_sum(objective, logits, per_depth, None, temperature)
    (loss + mtp_loss_scaling_factor / depths * mtp / tokens).backward()
    groups = {"main": [], "mtp": []}
    for name, parameter in model.named_parameters():
        groups["mtp" if name.startswith("mtp.") and detach else "main"].append(parameter.grad.flatten())
    metrics["grad-norm"] = torch.cat(groups["main"]).norm().item()
    if detach:
        metrics["mtp grad norm"] = torch.cat(groups["mtp"]).norm().item()
    return metrics
