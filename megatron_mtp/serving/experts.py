# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""How a Hugging Face checkpoint stores a layer's routed experts: one tensor per expert
(`mlp.experts.{e}.gate_proj.weight` [F, H], `up_proj` [F, H], `down_proj` [H, F]) or stacked
(`mlp.experts.gate_up_proj` [E, 2F, H], expert e's gate rows then its up rows, and
`mlp.experts.down_proj` [E, H, F]).

transformers 5 holds every MoE family's experts stacked (`Qwen3MoeExperts`, `DeepseekV3Experts`,
`Glm4MoeExperts`, `Qwen3NextExperts`, `Qwen3_5MoeExperts`: `gate_up_proj`, `down_proj`) and reads
both layouts (its conversion mapping merges the per-expert tensors on load); so the import takes
both, layer by layer, and the export writes the layout the family's published checkpoints use (its
adapter's published_experts: serving.families), or
the one `--expert-layout` names. Stacked expert e's `gate_up_proj[e]` is megatron-core's
`linear_fc1` [gate; up] of local expert e, and `down_proj[e]` its `linear_fc2`: both ways are
copies, bit for bit.
"""

import re

import torch

from megatron_mtp.serving import ServingError

STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def unstack(tensors: dict, expected: dict) -> dict:
    """A checkpoint's stacked experts as one tensor per expert, where `expected` (the per-expert
    names and shapes the config implies) holds that layer's experts; other names as they are (the
    name check reports them)."""
    counts = {}
    for name in expected:
        if (m := PER_EXPERT.fullmatch(name)) and m.group(3) == "gate_proj":
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    out = dict(tensors)
    for prefix in sorted({m.group(1) for name in tensors if (m := STACKED.fullmatch(name))} & set(counts)):
        if f"{prefix}.0.gate_proj.weight" in tensors:
            raise ServingError(f"{prefix} holds its experts both stacked (gate_up_proj, down_proj) and one per expert")
        if f"{prefix}.gate_up_proj" not in tensors or f"{prefix}.down_proj" not in tensors:
            raise ServingError(f"{prefix}: stacked experts need both gate_up_proj and down_proj")
        gate_up, down = out.pop(f"{prefix}.gate_up_proj"), out.pop(f"{prefix}.down_proj")
        (F, H), experts = expected[f"{prefix}.0.gate_proj.weight"], counts[prefix]
        for name, tensor, shape in ((f"{prefix}.gate_up_proj", gate_up, (experts, 2 * F, H)),
                                    (f"{prefix}.down_proj", down, (experts, H, F))):
            if tuple(tensor.shape) != shape:
                raise ServingError(f"tensor {name} has shape {list(tensor.shape)}, config.json implies {list(shape)}")
        for e in range(experts):
            # copies: a view would carry the whole stack's storage into whatever saves it
            gate, up = (t.clone() for t in torch.split(gate_up[e], F))
            out.update({f"{prefix}.{e}.gate_proj.weight": gate, f"{prefix}.{e}.up_proj.weight": up,
                        f"{prefix}.{e}.down_proj.weight": down[e].clone()})
    return out


def _layouts(published: tuple, choice: str) -> tuple:
    """(decoder layers, MTP depths) of an export: the family's published layout or the one chosen."""
    return published if choice == "published" else (choice, choice)


def stack(tensors: dict, published: tuple | None, choice: str, num_layers: int) -> dict:
    """One tensor per expert (the export's names) in the layout `choice` names (published: the
    family's `published`, (decoder layers, MTP depths), None for a family without experts;
    per_expert, stacked); the decoder layers are model.layers.{i}, i < num_layers, every other
    expert an MTP depth's."""
    if published is None:
        return tensors
    decoder, mtp = _layouts(published, choice)
    stacked = {}
    for name in tensors:
        if m := PER_EXPERT.fullmatch(name):
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if (decoder if layer and int(layer.group(1)) < num_layers else mtp) == "stacked":
                stacked[m.group(1)] = max(stacked.get(m.group(1), 0), int(m.group(2)) + 1)
    out = {name: t for name, t in tensors.items()
           if not ((m := PER_EXPERT.fullmatch(name)) and m.group(1) in stacked)}
    for prefix, experts in stacked.items():
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"],
                                                                tensors[f"{prefix}.{e}.up_proj.weight"]])
                                                     for e in range(experts)])
        out[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(experts)])
    return out


def describe(published: tuple | None, choice: str) -> str:
    """The layout an export writes, in words (its output line); `published` as stack's."""
    if published is None:
        return ""
    decoder, mtp = _layouts(published, choice)
    words = {"stacked": "stacked", "per_expert": "one per expert"}
    return f"experts {words[decoder]}" + ("" if mtp == decoder else f" ({words[mtp]} in the MTP depths)")
