# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""tools/eval_speculative.py's decoding, over the KV cache and by whole-sequence recompute, side by side.

    .venv/bin/python -m benchmarks.speculative_decoding_bench runs/default --new-tokens 32 128

For each --new-tokens N: the same prompts (the first --prompt-length tokens of documents of the
checkpoint's data) decoded as eval_speculative.py decodes them (speculative decoding with every
MTP depth drafting, then plain greedy decoding as the lossless reference), once over the KV cache
(megatron_mtp.serving) and once recomputing every forward from position 0
(tests/reference/speculative.py, what the tool did before the cache), the two taking turns
prompt by prompt. Both sides' outputs are checked equal. Printed: each side's seconds per
generated token and their ratio; a recompute's cost per token grows with the sequence, the
cache's should not (compare the rows of two N). With Gated DeltaNet layers (Qwen3-Next, Qwen3.5;
a HybridModel's `G` layers) also a count of work: the positions each side runs through the Gated DeltaNet layers per
generated token (the cache continues from each layer's recurrent state, the recompute runs every
position again). A checkpoint without data (an import) takes its prompts from the embedded
corpus, as eval_speculative.py does.
"""

import argparse
import os
import statistics
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch

    from megatron_mtp.serving import files, prompts, speculative
    from megatron_mtp.serving import model as serving_model
    from tests.reference import speculative as recompute

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    run_args, directory = files.read_arguments(args.checkpoint)
    serving_model.setup()
    model = serving_model.build(run_args)
    serving_model.load(model, str(directory))
    runner = serving_model.Runner(model, int(run_args.vocab_size or run_args.padded_vocab_size))
    depths = runner.depths
    from megatron_mtp.data.embedded import corpus_prefix, default_cache_dir

    prefix = next(iter(prompts.data_prefixes(run_args)), None) or str(corpus_prefix(default_cache_dir()))
    layers = f"HybridModel {run_args.hybrid_layer_pattern}" if getattr(run_args, "hybrid_layer_pattern", None) \
        else f"{run_args.num_layers} layers"
    print(f"{directory}: {layers}, hidden {run_args.hidden_size}, D = {depths}; "
          f"{args.num_prompts} prompts of {args.prompt_length} tokens from {prefix}; 1 thread")
    work = runner.cache.recurrent_positions  # positions run through Gated DeltaNet layers, by stream
    recurrent = (getattr(run_args, "experimental_attention_variant", None) == "gated_delta_net"
                 or "G" in (getattr(run_args, "hybrid_layer_pattern", None) or ""))
    extra = (" Gated DeltaNet positions per token, cache | recompute |", " --- | --- |") if recurrent else ("", "")
    print("| new tokens | KV cache, s per token | recompute, s per token | recompute / cache |" + extra[0])
    print("| --- | --- | --- | --- |" + extra[1])
    for new_tokens in args.new_tokens:
        pairs = prompts.dataset_prompts(prefix, args.num_prompts, args.prompt_length, new_tokens)
        cached, recomputed, cached_work, recomputed_work = [], [], [], []
        for prompt, _ in pairs:
            before = work.get("main", 0)
            started = time.perf_counter()
            output = speculative.speculative(runner, prompt, new_tokens, speculative.Stats(depths=depths))
            plain = speculative.greedy(runner, prompt, new_tokens)
            cached.append((time.perf_counter() - started) / new_tokens)
            cached_work.append((work.get("main", 0) - before) / new_tokens)
            before = work.get("main", 0)
            started = time.perf_counter()
            expected, _ = recompute.speculative(runner, prompt, new_tokens, depths)
            expected_plain = recompute.greedy(runner, prompt, new_tokens)
            recomputed.append((time.perf_counter() - started) / new_tokens)
            recomputed_work.append((work.get("main", 0) - before) / new_tokens)
            assert output == expected and plain == expected_plain, "the two sides decoded differently"
        cache_s, recompute_s = statistics.median(cached), statistics.median(recomputed)
        counts = (f" {statistics.median(cached_work):.1f} | {statistics.median(recomputed_work):.1f} |"
                  if recurrent else "")
        print(f"| {new_tokens} | {cache_s:.4f} | {recompute_s:.4f} | {recompute_s / cache_s:.2f} |{counts}", flush=True)


if __name__ == "__main__":
    main()
