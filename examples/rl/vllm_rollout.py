# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The RL example's rollouts from vLLM's CPU build (--engine vllm), as RL frameworks keep an engine alive
for a run.

--rollouts speculative: one engine samples the rollouts at temperature 1, each response with a seed of
its own, the heads drafting and vLLM's rejection sampler verifying (--draft-sample-method), and counts
what it accepted. --rollouts plain: one engine samples them by plain decoding (the rollouts depend on
the policy's weights alone: online, frozen and no heads keep one trajectory), and one drafts with the
heads, greedily, for its acceptance alone. The engines start on an export of the policy after the
warm start; before every step's rollouts the weight stream pushes the policy's weights into each in
place (serving.stream: the target's, and the drafter's into an engine that drafts).
"""

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from .rollout import Acceptance, Rollouts
from .task import EOS


class VllmRollouts:
    """The engines on rank 0. Every rank calls every method (the stream is a collective); rank 0 alone
    drives the engines, and its counts and times are the engine's (zeros elsewhere, so that a sum over
    the ranks is the engine's)."""

    def __init__(self, chunks, policy_args, depths: int, task, args, out: Path | None):
        import tempfile

        from megatron_mtp.serving import export, files, stream
        from megatron_mtp.serving.engines import vllm_engine

        self.chunks, self.policy_args, self.depths, self.task, self.args = chunks, policy_args, depths, task, args
        self.bucket_bytes = int(args.weight_bucket_mb * 2**20)
        self.speculative = args.rollouts == "speculative"
        # whether each engine drafts (the rollouts' engine first); the engines themselves on rank 0 alone
        self.drafts = [bool(depths)] if self.speculative else [False] + [True] * bool(depths)
        self.engines = [None] * len(self.drafts)
        self.engine_seed = None
        self.tokens = None  # where the speculative rollouts' tokens and steps go, one line per step
        hf = dict(stream.weights(chunks, policy_args))  # a collective
        if dist.get_rank() != 0:
            return
        plan = export.plan(policy_args)
        self.directory = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        files.write_hf(Path(self.directory.name), plan.cfg.to_hf("fp32", plan.layout), hf, "fp32", None)
        log = open(out / "engine.log", "w") if out is not None else None
        # vLLM's own generator (what a request without a seed draws from) seeded anew every run: a run
        # repeats through its responses' seeds alone, as it must where an RL framework's batches vary
        self.engine_seed = int.from_bytes(os.urandom(4), "little")
        speculative = {"method": "mtp", "num_speculative_tokens": depths}
        if self.speculative:
            speculative["draft_sample_method"] = args.draft_sample_method
        for index, drafts in enumerate(self.drafts):
            options = {"speculative_config": speculative} if drafts else {}
            self.engines[index] = vllm_engine.Engine(self.directory.name, log=log, seed=self.engine_seed, **options)
        if self.speculative and depths and out is not None:
            self.tokens = open(out / "engine_tokens.jsonl", "w")

    def push(self) -> int:
        """The policy's weights into every engine, in place (a collective); the bytes sent."""
        from megatron_mtp.serving import stream

        return sum(stream.update_engine(engine, self.chunks, self.policy_args, self.bucket_bytes, drafts=drafts)
                   for engine, drafts in zip(self.engines, self.drafts, strict=True))

    def sample(self, every_prompt: list, step: int, mine: slice) -> Rollouts:
        """G responses per prompt at temperature 1, response r's seed its key (as the decoder's rollouts
        key their Gumbel noise); this rank's share of them, and where the heads drafted them what the
        engine counted of this request. With --out, each step's prompts, seeds, responses, sampling
        steps and counters are a line of engine_tokens.jsonl (tools/eval_speculative.py --engine-tokens'
        fields)."""
        args, drafted = self.args, self.drafts[0]
        responses, counts, seconds = None, Acceptance(0, [0] * self.depths), 0.0
        if dist.get_rank() == 0:
            start = time.perf_counter()
            requests = [prompt for prompt in every_prompt for _ in range(args.group_size)]
            seeds = [args.seed * 10**9 + step * args.prompts_per_step * args.group_size + r
                     for r in range(len(requests))]
            reply = self.engines[0].generate(requests, self.task.answer_length, temperature=1.0, seeds=seeds,
                                             stop_token_ids=[EOS], steps=drafted)
            responses = reply["outputs"]
            if drafted:
                counts = Acceptance(reply["spec_decode"]["drafts"], reply["spec_decode"]["accepted per position"])
            if self.tokens is not None:
                self.tokens.write(json.dumps({
                    "iteration": step, "prompts": requests, "seeds": seeds, "outputs": responses,
                    "steps": reply["steps"], "temperature": 1.0, "draft_sample_method": args.draft_sample_method,
                    "spec_decode": reply["spec_decode"]}) + "\n")
                self.tokens.flush()
            seconds = time.perf_counter() - start
        shared = [responses]
        dist.broadcast_object_list(shared, src=0)
        share = slice(mine.start * args.group_size, mine.stop * args.group_size)
        return Rollouts(shared[0][share], counts if drafted else None, seconds)

    def greedy_acceptance(self, every_prompt: list) -> Acceptance:
        """--rollouts plain: vLLM's greedy speculative decode of every prompt in the drafting engine."""
        if dist.get_rank() != 0:
            return Acceptance(0, [0] * self.depths)
        counted = self.engines[1].generate(every_prompt, self.task.answer_length, stop_token_ids=[EOS])["spec_decode"]
        return Acceptance(counted["drafts"], counted["accepted per position"])

    def rollout_engine(self) -> dict:
        """The rollouts' engine (rank 0): the speculative decoding it runs, as vLLM's config holds it, and
        the seed of its own generator."""
        return {"speculative config": self.engines[0].speculative if self.engines[0] is not None else None,
                "seed": self.engine_seed}

    def close(self) -> None:
        for engine in self.engines:
            if engine is not None:
                engine.close()
        if self.tokens is not None:
            self.tokens.close()
