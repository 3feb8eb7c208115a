# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The weight stream's peak memory per rank against its batch size (serving.stream).

    .venv/bin/python -m benchmarks.weight_stream_bench [--buckets-mib 4 16 64] [--tp 2]

A Llama-shaped model with two MTP depths (hidden 1024, 8 layers, vocabulary 32000: about 0.7 GB of
fp32 weights) is built at TP = --tp on that many gloo ranks, one launch per row, and streamed whole:
in batches of each --buckets-mib (each batch dropped before the next, as an engine's weight update
consumes them: engines.vllm_engine.Engine.update_weights), and, as the RL example held it before the
stream went part by part, collected into one dict. Printed per row: the peak resident memory the
stream added on each rank (the kernel's high-water mark VmHWM, reset after the model is built, minus
the resident memory then), the batch size, the model's size, the largest part of the export a rank
gathers (mapping.hf_parts), and the streamed bytes (equal in every row). A rank holds one part's
global tensors and a batch at a time, so the peak should follow the largest part plus the batch, not
the model.
"""

import argparse
import os

# the depths in MiMo's layout, named: a Llama export leaves them out by default (no engine drafts for it)
LAYOUT = "mimo"


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def measure(tp: int, bucket_bytes: int | None) -> dict:
    """One rank's peak added memory while streaming the model (bucket_bytes None: collected whole)."""
    import dataclasses
    import gc

    import torch
    import torch.distributed as dist

    from megatron_mtp.library.model import build_model
    from megatron_mtp.serving import model as serving_model
    from megatron_mtp.serving import stream
    from megatron_mtp.serving.config import ModelConfig
    from tests.harness.layout import model_parallel

    torch.set_num_threads(1)
    cfg = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=2816,
                                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                   vocab_size=32000, max_position_embeddings=256, rms_norm_eps=1e-6,
                                   num_nextn_predict_layers=2, tie_word_embeddings=False, hidden_act="silu"),
                              pad_to=128 * tp)
    args = cfg.megatron_args()
    with model_parallel(tp):
        config = dataclasses.replace(serving_model.transformer_config(args), tensor_model_parallel_size=tp)
        chunks = build_model(config, args.padded_vocab_size, args.max_position_embeddings)
        model_bytes = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
        gc.collect()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current resident set
        before = _resident_kib("VmRSS")
        streamed = 0
        if bucket_bytes is None:
            held = dict(stream.weights(chunks, args, mtp_layout=LAYOUT))
            streamed = sum(t.numel() * t.element_size() for t in held.values())
            del held
        else:
            for batch in stream.buckets(stream.weights(chunks, args, mtp_layout=LAYOUT), bucket_bytes):
                streamed += sum(t.numel() * t.element_size() for _, t in batch)
        peak = _resident_kib("VmHWM") - before
        model_bytes_all = [None] * dist.get_world_size()
        dist.all_gather_object(model_bytes_all, model_bytes)
    return {"peak MiB": peak / 1024, "streamed MiB": streamed / 2**20, "model MiB": sum(model_bytes_all) / 2**20,
            "largest part MiB": _largest_part(cfg) / 2**20}


def _largest_part(cfg) -> int:
    """The bytes of the export's largest part (a decoder layer, an MTP depth, or the embedding / head)."""
    import re

    from megatron_mtp.serving import mapping

    parts = {}
    for name, shape in mapping.hf_shapes(cfg, LAYOUT, cfg.mtp_num_layers).items():
        layer = re.match(r"(model\.(?:mtp_)?layers\.\d+)\.", name)
        key = layer.group(1) if layer else name
        numel = 1
        for size in shape:
            numel *= size
        parts[key] = parts.get(key, 0) + 4 * numel
    return max(parts.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets-mib", type=float, nargs="+", default=[4, 16, 64])
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from tests.harness.launcher import launch

    print("| batch | peak added per rank (rank 0 / rank 1 ...) | model (all ranks) | largest part | streamed |")
    print("| --- | --- | --- | --- | --- |")
    for bucket in [*args.buckets_mib, None]:
        rows = launch("benchmarks.weight_stream_bench:measure", args.tp,
                      {"tp": args.tp, "bucket_bytes": None if bucket is None else int(bucket * 2**20)}, timeout=900)
        peaks = " / ".join(f"{row['peak MiB']:.0f} MiB" for row in rows)
        first = rows[0]
        label = "whole model (collected in one dict)" if bucket is None else f"{bucket:g} MiB"
        print(f"| {label} | {peaks} | {first['model MiB']:.0f} MiB | {first['largest part MiB']:.0f} MiB | "
              f"{first['streamed MiB']:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
