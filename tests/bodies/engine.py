# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The project's decoder on the engine tier's checkpoint (tests/test_engine.py): per prompt, greedy
plain decoding and speculative decoding with each draft chain at each depth (its counts and every draft
step's logits), and the smallest margin
between the two largest logits of any argmax the decode took (a tie within the engine's round-off
may go either way there, so the test compares only prompts whose decisions are clear)."""

import torch

from megatron_mtp.serving import files, speculative
from megatron_mtp.serving import model as serving_model


def decode(checkpoint: str, prompts: list, new_tokens: int, depths: list, rounded_to: str | None = None) -> dict:
    """`rounded_to` ("bf16", "fp32"): the checkpoint's weights rounded to that dtype before decoding in
    fp32, so that they are the values an export in that dtype holds (what differs from a bf16 engine is
    its arithmetic alone)."""
    torch.set_grad_enabled(False)
    run_args, directory = files.read_arguments(checkpoint)
    serving_model.setup()
    model = serving_model.build(run_args)
    serving_model.load(model, str(directory))
    if rounded_to is not None:
        # the state dict's tensors share the model's storage: parameters and the persistent buffers the
        # export writes (the routers' expert bias), not the rotary tables it computes
        for value in model.state_dict().values():
            if torch.is_tensor(value) and value.is_floating_point():
                value.copy_(value.to({"bf16": torch.bfloat16, "fp32": torch.float32}[rounded_to]))
    runner = serving_model.Runner(model, int(run_args.vocab_size or run_args.padded_vocab_size))
    margins = []

    def choose(logits, first_position):
        top = logits.float().topk(2, dim=-1).values
        margins.append(float((top[:, 0] - top[:, 1]).min()))
        return logits.argmax(-1).tolist()

    out = {"plain": [], "margin": []}
    for prompt in prompts:
        margins.clear()
        out["plain"].append(speculative.greedy(runner, prompt, new_tokens, choose=choose))
        for chain in speculative.CHAINS:
            for depth in depths:
                stats, draft_logits = speculative.Stats(depths=depth), []
                tokens = speculative.speculative(runner, prompt, new_tokens, stats, depths=depth, choose=choose,
                                                 chain=chain, draft_logits=draft_logits)
                out.setdefault(f"{chain} {depth}", []).append(
                    {"tokens": tokens, "drafts": stats.drafts, "accepted per position": stats.accepted_per_position,
                     # every draft step's logits row, in drafting order (depth 1 .. D of each drafting)
                     "draft logits": [row.tolist() for rows in draft_logits for row in rows]})
        out["margin"].append(min(margins))
    return out


def update(old_export: str, checkpoint: str, pp: int, prompts: list, new_tokens: int, depth: int,
           bucket_bytes: int, engine_timeout: float) -> dict:
    """A vLLM engine started on `old_export`, updated in place from the live model of `checkpoint` (built
    at PP = `pp` on the launch's ranks and loaded from it) by the weight stream, the target first
    alone (the control: a drafter left with its old weights), then target and drafter; rank 0 drives
    the engine and returns its greedy outputs and spec-decode counters after each, one request per
    prompt. The prompts are decoded once before any update too, so that a prefix cache kept across the
    update would show."""
    import dataclasses

    import torch.distributed as dist

    from megatron_mtp.library.model import build_gpt, gpt_options
    from megatron_mtp.serving import stream
    from megatron_mtp.serving.engines import vllm_engine
    from tests.harness.layout import model_parallel

    torch.set_grad_enabled(False)
    run_args, directory = files.read_arguments(checkpoint)
    out = {}
    with model_parallel(pp=pp):
        config = dataclasses.replace(serving_model.transformer_config(run_args), pipeline_model_parallel_size=pp,
                                     pipeline_dtype=torch.float32)
        model = build_gpt(config, run_args.padded_vocab_size, run_args.max_position_embeddings, **gpt_options(run_args))
        serving_model.load(model, str(directory))
        chunks = [model]
        engine = None
        if dist.get_rank() == 0:
            spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": depth}}
            engine = vllm_engine.Engine(old_export, start_timeout=engine_timeout, request_timeout=engine_timeout,
                                        **spec)
        try:
            for phase, drafts in (("before", None), ("target only", False), ("target and drafter", True)):
                if drafts is not None:
                    sent = stream.update_engine(engine, chunks, run_args, bucket_bytes, drafts=drafts)
                    out[f"{phase} bytes"] = sent
                if engine is not None:
                    out[phase] = [engine.generate([prompt], new_tokens) for prompt in prompts]
        finally:
            if engine is not None:
                engine.close()
    return out


def score(checkpoint: str, records: dict) -> dict:
    """The engine's sampled responses scored by the project's model on `checkpoint`, per record (one engine:
    its depth, its draft mode): the responses sampled at temperature 1 replayed along vLLM's draft chain
    (serving.engine_replay: the steps' own counts, and per depth the steps that reached it, the drafts it
    accepted there and the sum and variance of the probabilities it had to), and every group of responses
    (one temperature and top-p) scored token by token against p (tests/harness/sampling.py: the
    Kolmogorov-Smirnov p-value of the randomized PIT, the calibration z)."""
    from megatron_mtp.serving import engine_replay
    from tests.harness import sampling

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # small matrices: threads cost more than they give
    run_args, directory = files.read_arguments(checkpoint)
    serving_model.setup()
    model = serving_model.build(run_args)
    serving_model.load(model, str(directory))
    runner = serving_model.Runner(model, int(run_args.vocab_size or run_args.padded_vocab_size))
    out = {}
    for name, record in records.items():
        stats, counts, mismatches = speculative.Stats(depths=record["depth"]), speculative.Stats(record["depth"]), 0
        replayed = record["replayed"]
        for prompt, steps in zip(replayed["prompts"], replayed["steps"], strict=True):
            sampler = engine_replay.replay(runner, prompt, steps, stats, replayed["temperature"],
                                           record["draft_sample_method"])
            counts.add_counts(sampler.counts)
            mismatches += sampler.greedy_mismatches
        groups = {}
        generator = torch.Generator().manual_seed(0)
        for part in record["scored"]:
            for prompt, output, temperature, top_p in zip(part["prompts"], part["outputs"], part["temperatures"],
                                                          part["top_ps"], strict=True):
                group = groups.setdefault(f"temperature {temperature}, top_p {top_p}",
                                          {"u": [], "dev": 0.0, "var": 0.0})
                u, deviation, variance = sampling.scores(runner, prompt, output, temperature, top_p, generator)
                group["u"] += u
                group["dev"] += deviation
                group["var"] += variance
        out[name] = {"drafts": counts.drafts, "accepted per position": counts.accepted_per_position,
                     "reached": stats.drafted_reached, "accepted": stats.drafted_accepted,
                     "expected": stats.drafted_overlap, "variance": stats.drafted_variance,
                     "greedy mismatches": mismatches,
                     "groups": {key: {"tokens": len(g["u"]), "ks p": sampling.ks_p_value(g["u"]),
                                      "z": g["dev"] / g["var"] ** 0.5} for key, g in groups.items()}}
    return out
