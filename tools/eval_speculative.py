#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Speculative decoding with a checkpoint's MTP depths as drafts: the acceptance a server sees.

    tools/eval_speculative.py runs/default                      # prompts from the run's own data
    tools/eval_speculative.py RUN_DIR --prompts prompts.txt --tokenizer bytes --new-tokens 64
    tools/eval_speculative.py RUN_DIR --sampler rejection --temperature 1.0 --seed 1
    tools/eval_speculative.py RUN_DIR --sampler rejection --draft-sample-method greedy   # vLLM's default
    tools/eval_speculative.py RUN_DIR --engine-tokens engine.json   # predict what an engine accepted

Decoding where depth k drafts token t+k+1 from the accepted prefix (the chain the depths were
trained on) and the main head verifies every draft (megatron_mtp.serving.speculative), with
--sampler: greedy (the default), gumbel (per-position Gumbel noise at --temperature, keyed by
--seed and the prompt's index) or rejection (the engines' rejection sampling at --temperature,
as vLLM's rejection sampler does, in either of its --draft-sample-method modes: probabilistic,
drafts drawn from the depths' softmax, accepted with min(1, p/q), a rejection resampled from
norm(max(0, p - q)) (vLLM's opt-in draft_sample_method="probabilistic"); greedy, drafts the depths'
argmax, accepted with p(draft), a rejection resampled from p without the draft (vLLM's default
"greedy"); default probabilistic, this tool's rejection sampler before the greedy mode existed).
Greedy and Gumbel output is checked
against plain decoding with the same sampler token for token (lossless; a difference is an
error, exit status 1); rejection sampling is lossless in distribution only, which tests/ check,
so its output is not compared ("lossless": null). Reported, with the definitions named:

- acceptance per depth: vLLM's per-position rate (drafts accepted at position k / verify steps);
- conditional acceptance per depth: drafts accepted at depth k / verify steps in which every
  draft before depth k was accepted (under rejection sampling, what the trainer's teacher-forced
  `mtp_k sampled acceptance`, the mean of sum_v min(p, q), estimates; with greedy drafts its
  `mtp_k greedy-draft acceptance`, the mean of p(argmax q));
- draft acceptance rate: accepted / drafted tokens (vLLM);
- mean acceptance length with the bonus token: tokens emitted per verify step, 1 + accepted /
  verify steps (vLLM's mean acceptance length; SGLang's accept length, sum(accepted + 1) / verify
  steps, is the same number when every verify step carries drafts, as here);
- target forward passes per generated token (the prefill included);
- with --draft-chain vllm, the drafts are chained as vLLM 0.32's MiMo MTP chains them (depth 1's layer
  at every draft step over one KV cache, the embedding at position 0 zeroed, the first step on the
  main model's states before its final norm: VllmDrafter), whose counts are vLLM's own; the default
  chains them as trained;
- beside them, the trainer's teacher-forced acceptance (spec section 7: depth k's argmax against
  the text's own token) on the same texts: the prompt and the data's continuation (or, with
  --prompts, the prompt and the plain decoding's continuation); its greedy-draft acceptance (spec
  section 12.1: the mean of p(argmax q) at --temperature, what vLLM's default greedy drafts are
  accepted with; with --sampler greedy, whether argmax q is the main head's argmax); when
  sampling, also its sampled acceptance at --temperature (spec section 12: the mean of
  sum_v min(p, q), what probabilistic drafts are accepted with); and for both, the expected
  accepted length of the chained drafts, 1 + sum_j mean_t prod_{i<=j} (incl. bonus): both modes'
  predictions, whichever mode decodes;
- with --sampler rejection, the expected conditional acceptance per depth: the probability each
  verify step had to accept the draft of each depth it reached, sum_v min(p, q) (with greedy drafts:
  p(argmax q)), p and q the main head's and the drafter's distributions along --draft-chain, summed
  over the steps that reached it (megatron_mtp.serving.engine_replay replays the decode's steps),
  and the conditional acceptance's distance from it in standard errors (`conditional acceptance z
  per depth`; |z| beyond about 4 says the verifier does not accept what the heads draft).

--engine-tokens FILE predicts an engine's counts from its own tokens: FILE is JSON, {"prompts":
[[ids], ...], "steps": [...], "temperature": T, "draft_sample_method": "greedy" or "probabilistic",
"spec_decode": {...}}, as vllm_engine.Engine.generate(..., steps=True) answers with the request's
prompts, temperature and the engine's draft_sample_method added ("steps": every sampling step of
each response, [drafts verified, [tokens]]; "spec_decode", optional: the engine's counters). The
engine's verify steps are replayed along --draft-chain (default here: vllm, the chain vLLM's MiMo
MTP runs) and each depth's expected accepted count and its z are reported beside the engine's own
count; the counts the steps hold must equal the engine's counters. Reported beside them, the
teacher-forced acceptances on corpus text (--num-prompts documents of the dataset, prompt and the
data's continuation), which predict another thing: what drafts of data text would be accepted,
not what the engine accepted on its own samples (docs/serving.md).

Prompts: --data-path PREFIX (a megatron-core indexed dataset; default: the run's first dataset,
a blend's weights skipped, else the embedded corpus): the first --prompt-length tokens of
--num-prompts documents spread over the dataset; or --prompts FILE, one prompt per line, encoded
with the checkpoint's own tokenizer (the one its data was written with, or its Megatron-LM
--tokenizer-type / --tokenizer-model; a NullTokenizer reads space-separated ids), or with
--tokenizer (bytes, a tokenizer.json or a SentencePiece model).

Runs on CPU, megatron-core's GPTModel or HybridModel loaded in one process from any saved TP / PP /
VPP layout, each forward over a KV cache (megatron_mtp.serving.kv_cache): a verify step runs the accepted
token and the drafts, a depth the positions it has not taken for good, so the cost per token
does not grow with a recompute of the whole sequence. megatron-core 0.19.2's dynamic inference
engine with MTP speculative decoding (num_speculative_tokens,
text_generation_controllers/mtp_utils_pytorch.py) is not used here: its context, engine and
controller allocate CUDA buffers, streams and graphs throughout (about 320 `cuda` references),
outside what the series' runtime-only CPU patches cover; its static context turns the causal mask
off after the prefill (one new token per step), which a verify step of D + 1 tokens cannot use.
MoE checkpoints run with upstream's MoE layers at one rank (the experts resharded by dist
checkpointing), as the trainer builds them on CPU; Gated DeltaNet layers (GPTModel's
--experimental-attention-variant gated_delta_net: Qwen3-Next, Qwen3.5) with their convolution
inputs and recurrent state in the same cache (megatron_mtp.serving.recurrent); a HybridModel
(--hybrid-layer-pattern) with its attention layers over the KV cache and its Gated DeltaNet layers,
in the decoder and in the MTP depths, over the recurrent cache, as the trainer builds it; one with
Mamba layers is refused in one line.
Progress goes to stderr.
"""

import argparse
import functools
import json
import os
import sys
import time
import warnings

from megatron_mtp import cli

PROG = "eval_speculative.py"
CHAINS = ("trained", "vllm")  # megatron_mtp.serving.speculative.CHAINS (not imported before the arguments are read)
fail = functools.partial(cli.fail, PROG)  # one line on stderr, exit status 2 (or given)


def parse(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="trainer checkpoint (--save directory, or an iteration directory)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data-path", help="megatron-core indexed dataset prefix the prompts come from")
    source.add_argument("--prompts", help="file of prompts, one per line")
    parser.add_argument("--tokenizer", help="encodes --prompts: bytes, a tokenizer.json or a SentencePiece .model "
                                            "(default: the checkpoint's own tokenizer)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=32, help="tokens of each document used as prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--depths", type=int, default=None, help="draft with the first D depths (default: all)")
    parser.add_argument("--sampler", choices=("greedy", "gumbel", "rejection"), default="greedy",
                        help="how tokens are chosen and drafts verified (default: greedy)")
    parser.add_argument("--temperature", type=float, help="softmax temperature of gumbel and rejection (default 1)")
    parser.add_argument("--draft-sample-method", choices=("probabilistic", "greedy"),
                        help="rejection's drafts, as vLLM's speculative_config draft_sample_method: sampled from "
                             "the depth's softmax (probabilistic, the default here) or its argmax (greedy, vLLM's "
                             "default)")
    parser.add_argument("--seed", type=int, default=1, help="the samplers' random streams (with the prompt's index)")
    parser.add_argument("--draft-chain", choices=tuple(CHAINS),
                        help="how the depths chain their drafts: as trained (depth k runs at draft step k over "
                             "its own states), or as vLLM runs them (depth 1's layer at every step, over one KV "
                             "cache; megatron_mtp.serving.speculative.VllmDrafter) (default: trained; with "
                             "--engine-tokens, vllm)")
    parser.add_argument("--engine-tokens", metavar="FILE",
                        help="an engine's responses with their sampling steps (JSON): predict its counts")
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def read_engine_tokens(path: str) -> dict:
    """--engine-tokens' file, checked: prompts and steps of equal count, a temperature > 0, a draft mode."""
    from megatron_mtp.serving import ServingError
    from megatron_mtp.serving.speculative import DRAFT_SAMPLE_METHODS

    try:
        with open(path) as file:
            record = json.load(file)
    except (OSError, ValueError) as error:
        raise ServingError(f"--engine-tokens {path}: {error}") from None
    missing = [name for name in ("prompts", "steps", "temperature", "draft_sample_method") if name not in record]
    if missing:
        raise ServingError(f"--engine-tokens {path} holds no {', '.join(missing)}")
    if len(record["prompts"]) != len(record["steps"]) or not record["prompts"]:
        raise ServingError(f"--engine-tokens {path}: {len(record['prompts'])} prompts, {len(record['steps'])} "
                           f"responses' steps")
    if not isinstance(record["temperature"], (int, float)) or not record["temperature"] > 0:
        raise ServingError(f"--engine-tokens {path}: temperature {record['temperature']!r} (one number > 0: a "
                           f"greedy engine's counts are the greedy decoder's, --sampler greedy)")
    if record["draft_sample_method"] not in DRAFT_SAMPLE_METHODS:
        raise ServingError(f"--engine-tokens {path}: draft_sample_method {record['draft_sample_method']!r} is not "
                           f"one of {', '.join(DRAFT_SAMPLE_METHODS)}")
    counted = record.get("spec_decode")
    if counted:  # the steps must hold what the engine counted
        accepted = [len(tokens) - 1 for response in record["steps"] for verified, tokens in response if verified]
        depths = len(counted.get("accepted per position") or [])
        held = (len(accepted), [sum(a > k for a in accepted) for k in range(depths)])
        if held != (counted.get("drafts"), counted.get("accepted per position")):
            raise ServingError(f"--engine-tokens {path}: the steps hold {held[0]} verify steps and {held[1]} accepted "
                               f"per position, the engine counted {counted.get('drafts')} and "
                               f"{counted.get('accepted per position')}")
    return record


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch

    from megatron_mtp.serving import ServingError, engine_replay, files, prompts, speculative
    from megatron_mtp.serving import model as serving_model

    torch.set_grad_enabled(False)
    engine = None
    try:
        for name in ("num_prompts", "prompt_length", "new_tokens"):
            if getattr(args, name) < 1:
                raise ServingError(f"--{name.replace('_', '-')} must be >= 1")
        if args.engine_tokens:
            given = [flag for flag, value in (("--sampler", args.sampler != "greedy"),
                                              ("--temperature", args.temperature is not None),
                                              ("--draft-sample-method", args.draft_sample_method is not None),
                                              ("--prompts", args.prompts is not None),
                                              ("--depths", args.depths is not None)) if value]
            if given:
                raise ServingError(f"--engine-tokens: the engine's file gives the prompts, temperature, draft mode "
                                   f"and depths ({', '.join(given)} given)")
            engine = read_engine_tokens(args.engine_tokens)
        if args.sampler == "greedy" and args.temperature is not None:
            raise ServingError("--temperature applies to --sampler gumbel or rejection; greedy takes the argmax")
        if args.draft_sample_method is not None and args.sampler != "rejection":
            raise ServingError("--draft-sample-method applies to --sampler rejection")
        draft_sample_method = engine["draft_sample_method"] if engine else args.draft_sample_method or "probabilistic"
        temperature = engine["temperature"] if engine else 1.0 if args.temperature is None else args.temperature
        chain = args.draft_chain or ("vllm" if engine else "trained")
        if args.sampler != "greedy" and not temperature > 0:
            raise ServingError(f"--temperature {args.temperature} must be > 0")
        if args.tokenizer is not None and not args.prompts:
            raise ServingError("--tokenizer encodes --prompts; without --prompts the prompts are a dataset's tokens")
        run_args, directory = files.read_arguments(args.checkpoint)
        if run_args is None:
            raise ServingError(f"{directory}: the checkpoint holds no arguments")
        serving_model.check_buildable(run_args)
        depths = run_args.mtp_num_layers or 0
        if not depths:
            raise ServingError(f"{directory}: the model has no MTP depths to draft with")
        use = depths if args.depths is None else args.depths
        if engine:
            use = max((verified for steps in engine["steps"] for verified, _ in steps), default=0)
            if not 1 <= use <= depths:
                raise ServingError(f"--engine-tokens: the engine verified {use} drafts a step, the model has {depths} "
                                   f"MTP depths")
        if not 1 <= use <= depths:
            raise ServingError(f"--depths {args.depths}: the model has {depths} MTP depths")
        if args.prompts:
            encoder = prompts.tokenizer(run_args, args.tokenizer)
            pairs = [(prompt, None) for prompt in prompts.file_prompts(args.prompts, encoder.encode, args.num_prompts)]
            source = args.prompts
        else:
            from megatron_mtp.data.embedded import corpus_prefix, default_cache_dir

            prefix = args.data_path or next(iter(prompts.data_prefixes(run_args)), None) \
                or str(corpus_prefix(default_cache_dir()))
            pairs = prompts.dataset_prompts(prefix, args.num_prompts, args.prompt_length, args.new_tokens)
            source = prefix
        vocab = int(getattr(run_args, "vocab_size", None) or run_args.padded_vocab_size)
        for prompt in [p for p, _ in pairs] + (engine["prompts"] if engine else []):
            if not prompt or max(prompt) >= vocab:
                raise ServingError(f"a prompt is empty or holds a token id >= the vocabulary {vocab}")
        longest = max(len(p) for p, _ in pairs) + args.new_tokens + use
        if (getattr(run_args, "position_embedding_type", "rope") != "rope"
                and longest > run_args.max_position_embeddings):
            raise ServingError(f"prompt + new tokens + drafts = {longest} positions, the model has "
                               f"{run_args.max_position_embeddings}")
    except ServingError as error:
        return fail(error)

    started = time.monotonic()
    serving_model.setup()
    model = serving_model.build(run_args)
    serving_model.load(model, str(directory))
    runner = serving_model.Runner(model, vocab)
    stats = speculative.Stats(depths=use)
    if engine:
        print(f"{PROG}: {directory}, the engine's {len(engine['prompts'])} responses at temperature {temperature}, "
              f"{draft_sample_method} drafts, {use} of {depths} MTP depths, replayed along the {chain} chain",
              file=sys.stderr, flush=True)
        mismatches = 0
        for prompt, steps in zip(engine["prompts"], engine["steps"], strict=True):
            try:
                replayed = engine_replay.replay(runner, prompt, steps, stats, temperature, draft_sample_method, chain)
            except ValueError as error:
                return fail(f"--engine-tokens: a response's steps do not replay: {error}", 1)
            mismatches += replayed.greedy_mismatches
            stats.add_counts(replayed.counts)
        for _, reference in pairs:  # the teacher-forced acceptances on corpus text (prompt and data), beside them
            speculative.teacher_forced(runner, reference, stats, temperature)
        summary = stats.summary()
        summary.update({"engine responses": len(engine["prompts"]), "depths": use, "checkpoint": str(directory),
                        "temperature": temperature, "draft sample method": draft_sample_method, "draft chain": chain,
                        "greedy drafts accepted that are not this chain's argmax": mismatches,
                        "teacher-forced text": f"{len(pairs)} prompts of {source} + the data's continuation"})
        return report(summary, args.json)

    mismatches = []
    sampled = args.sampler != "greedy"
    print(f"{PROG}: {directory}, {len(pairs)} prompts from {source}, {args.new_tokens} new tokens, "
          f"{use} of {depths} MTP depths drafting, {args.sampler}"
          + (f" at temperature {temperature}" if sampled else "")
          + (f", {draft_sample_method} drafts" if args.sampler == "rejection" else ""), file=sys.stderr, flush=True)
    samplers = {"greedy": lambda key: speculative.greedy_choice,
                "gumbel": lambda key: speculative.GumbelSampler(args.seed, key, temperature),
                "rejection": lambda key: speculative.RejectionSampler(args.seed, key, temperature, draft_sample_method)}
    for i, (prompt, reference) in enumerate(pairs):
        steps = []
        output = speculative.speculative(runner, prompt, args.new_tokens, stats, depths=use,
                                         choose=samplers[args.sampler](i), steps=steps, chain=chain)
        if args.sampler == "rejection":  # what its verify steps should have accepted, along the same chain
            engine_replay.replay(runner, prompt, steps, stats, temperature, draft_sample_method, chain)
        # a rejection sampler's plain decoding draws from a stream of its own (the outputs agree in
        # distribution only); Gumbel's uses the same key, whose noise gives the same tokens
        plain = speculative.greedy(runner, prompt, args.new_tokens,
                                   choose=samplers[args.sampler](len(pairs) + i if args.sampler == "rejection" else i))
        if args.sampler != "rejection" and output != plain:
            first = next((j for j, (a, b) in enumerate(zip(output, plain)) if a != b), min(len(output), len(plain)))
            mismatches.append(f"prompt {i}: token {first} is {output[first] if first < len(output) else None} "
                              f"with drafts, {plain[first] if first < len(plain) else None} in plain decoding")
        speculative.teacher_forced(runner, reference if reference is not None else prompt + plain, stats,
                                   temperature if sampled else None)
        elapsed = time.monotonic() - started
        eta = time.strftime("%H:%M:%S", time.gmtime(elapsed / (i + 1) * (len(pairs) - i - 1)))
        print(f"{PROG}: prompt {i + 1}/{len(pairs)} done ({elapsed:.0f} s, ETA {eta})", file=sys.stderr, flush=True)
    summary = stats.summary()
    summary.update({"lossless": None if args.sampler == "rejection" else not mismatches, "prompts": len(pairs),
                    "new tokens per prompt": args.new_tokens, "depths": use, "checkpoint": str(directory),
                    "sampler": args.sampler, "temperature": temperature if sampled else None,
                    "draft sample method": draft_sample_method if args.sampler == "rejection" else None,
                    "draft chain": chain,
                    "teacher-forced text": "prompt + plain decoding's output" if args.prompts
                    else "prompt + the data's continuation"})
    status = report(summary, args.json)
    if mismatches:
        return fail("speculative output differs from plain decoding: " + "; ".join(mismatches[:3]), 1)
    return status


def report(summary: dict, path: str | None) -> int:
    for key, value in summary.items():
        shown = [round(v, 4) if isinstance(v, float) else v for v in value] if isinstance(value, list) else \
            round(value, 4) if isinstance(value, float) else value
        print(f"{key}: {shown}")
    if path:
        with open(path, "w") as file:
            json.dump(summary, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
