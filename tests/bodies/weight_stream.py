# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The weight stream of a live distributed model against the files export writes from its checkpoint.

A model of a family (its arguments as an import writes them, ModelConfig.megatron_args) is built at a
TP x PP x EP layout on the launch's gloo ranks, every rank's parameters drawn from a seed of its own
(so a shard put in another's place, or a replica taken for a main one, changes a tensor), saved
through dist checkpointing with its arguments, streamed (serving.stream.weights) and, on rank 0,
exported by tools/convert_checkpoint.py from the saved checkpoint. Rank 0 compares the names and
every tensor's bytes.
"""

import contextlib
import dataclasses
import importlib.util
import io
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mtp.library.checkpointing import model_state
from megatron_mtp.library.model import build_model
from megatron_mtp.patched_core import REPO_ROOT
from megatron_mtp.serving import model as serving_model
from megatron_mtp.serving import stream
from megatron_mtp.serving.config import ModelConfig
from tests.harness.layout import model_parallel

_COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6,
               num_nextn_predict_layers=2, tie_word_embeddings=False, hidden_act="silu")
FAMILIES = {
    "llama": dict(_COMMON, architectures=["LlamaForCausalLM"]),
    "qwen3_moe": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True),
}


def _convert_checkpoint():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(REPO_ROOT) / "tools/convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exported(directory: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def compare(root: str, family: str, tp: int = 1, pp: int = 1, ep: int = 1, vpp: int | None = None,
            options: tuple = ()) -> dict:
    """Stream and export (with `options`: export's flags, streamed as the same keyword arguments)
    of one model at a layout."""
    cfg = ModelConfig.from_hf(FAMILIES[family], pad_to=128 * tp)
    args = cfg.megatron_args()
    flags = dict(zip(options[::2], options[1::2], strict=True))
    keywords = {name.lstrip("-").replace("-", "_"): value for name, value in flags.items()}
    case = Path(root) / f"{family}-tp{tp}-pp{pp}-vpp{vpp}-ep{ep}{'-'.join(('', *flags.values()))}"
    with model_parallel(tp, pp, vpp, ep=ep):
        fields = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                      virtual_pipeline_model_parallel_size=vpp)
        if cfg.moe:
            fields.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, sequence_parallel=tp > 1)
        config = dataclasses.replace(serving_model.transformer_config(args), **fields)
        chunks = build_model(config, args.padded_vocab_size, args.max_position_embeddings,
                             share_embeddings_and_output_weights=cfg.tied)
        generator = torch.Generator().manual_seed(1000 + dist.get_rank())
        with torch.no_grad():
            for chunk in chunks:
                for _, param in sorted(chunk.module.named_parameters()):
                    param.copy_(torch.randn(param.shape, generator=generator))
        checkpoint = case / "checkpoint"
        if dist.get_rank() == 0:
            checkpoint.mkdir(parents=True)
        dist.barrier()
        from megatron.core import dist_checkpointing

        dist_checkpointing.save({**model_state(chunks), "args": args}, str(checkpoint))
        streamed = [(name, tensor.clone()) for name, tensor in stream.weights(chunks, args, **keywords)]
        warned = stream.warnings(args, keywords.get("mtp_layout"))
    if dist.get_rank() != 0:
        return {}
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        status = _convert_checkpoint().main(["export", str(checkpoint), str(case / "hf"), *options])
    written = _exported(case / "hf")
    names = [name for name, _ in streamed]
    return {"status": status, "said": said.getvalue(), "streamed": len(names), "written": len(written),
            "names only one side": sorted(set(names) ^ set(written)), "repeated names": len(names) - len(set(names)),
            "differ": [name for name, tensor in streamed if name in written and not _same_bytes(tensor, written[name])],
            "mtp names": sum(n.startswith(("model.mtp_layers.", "mtp.")) or (
                n.startswith("model.layers.") and int(n.split(".")[2]) >= cfg.num_layers) for n in names),
            "expert names": sum(".experts." in n for n in names), "warnings": warned,
            "dtypes": sorted({str(t.dtype) for _, t in streamed})}
