# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The RL example's rollouts from the project's decoder, and what a decode's drafts were accepted.

Each rank is a rollout engine: a model of its own with its KV cache (megatron_mtp.serving.model), its
weights taken from the weight stream before every step's rollouts as an RL framework pushes them. It
samples G responses per prompt of its share by speculative decoding (megatron_mtp.serving.speculative,
the decoder of tools/eval_speculative.py), the MTP depths drafting and the main head verifying. Tokens
are drawn by Gumbel noise keyed by (seed, response, position), so the rollouts are exactly plain
sampling's, with or without drafts: online, frozen and no heads keep one trajectory.
"""

import time
from dataclasses import dataclass

import torch

from .step import all_sum
from .task import EOS


@dataclass
class Acceptance:
    """A decode's verify steps and drafts accepted at each position (vLLM's counting)."""

    drafts: float
    accepted: list[float]  # depth k at accepted[k - 1]

    @classmethod
    def of(cls, stats) -> "Acceptance":
        """A speculative.Stats' counts."""
        return cls(stats.drafts, list(stats.accepted_per_position))

    def summed(self) -> "Acceptance":
        """Over the ranks (a collective)."""
        drafts, *accepted = all_sum([self.drafts, *self.accepted])
        return Acceptance(drafts, accepted)

    def rates(self) -> list[float]:
        """Each depth's per-position rate: accepted / verify steps."""
        return [count / max(self.drafts, 1) for count in self.accepted]

    def mean_length(self) -> float:
        """Tokens per verify step, the bonus token included."""
        return 1 + sum(self.accepted) / max(self.drafts, 1)


@dataclass
class Rollouts:
    """One step's rollouts on this rank: its share of the responses, G per prompt in prompt order."""

    responses: list
    acceptance: Acceptance | None  # as the engine counted its drafts (None: nothing drafted)
    seconds: float  # this rank's sampling time


class DecoderRollouts:
    """The project's decoder as this rank's rollout engine, over `model` (the rollout model)."""

    def __init__(self, model, task, args, depths: int):
        from megatron_mtp.serving.model import Runner

        self.model, self.task, self.args, self.depths = model, task, args, depths
        self.runner = Runner(model, task.vocab_size)

    def refresh(self, chunks, policy_args) -> bool:
        """The policy's weights into the rollout engine, as an RL framework pushes them after every step: the
        weight stream's (name, tensor) in Hugging Face names (what vLLM's load_weights and SGLang's
        update_weights_from_tensor take; docs/serving.md), loaded here by the import's mapping. A collective:
        every rank streams. Returns whether the engine holds what it was sent, bit for bit: its weights in
        the stream's names equal the stream's. (Its own tensors may differ from the policy's in the last
        bit where the family stores a norm as 1 + w: Qwen3.5's Gated DeltaNet output norm; see
        `largest_difference`.)"""
        from megatron_mtp.serving import export, mapping, stream
        from megatron_mtp.serving.config import ModelConfig

        # the decoder drafts with every trained depth, whatever the family: its own layout (an export
        # leaves out the depths of a family no engine drafts for)
        layout = mapping.default_mtp_layout(ModelConfig.from_megatron_args(policy_args)) if policy_args.mtp_num_layers \
            else "none"
        plan = export.plan(policy_args, layout)
        hf = dict(stream.weights(chunks, policy_args, mtp_layout=layout))
        depths = plan.cfg.mtp_num_layers if plan.layout else 0
        own = mapping.hf_to_megatron(hf, plan.cfg, plan.layout, depths)
        if plan.cfg.mtp_repeated:  # the one layer the engine runs at every depth, as the import holds it
            own = mapping.collapse_repeated(own, depths)
        missing, unexpected = self.model.load_state_dict(own, strict=False)
        left = [name for name in missing if "_extra_state" not in name]
        if unexpected or left:
            raise RuntimeError(f"the stream does not fill the engine's model: {(unexpected + left)[:3]}")
        held = export.hf_tensors(plan, dict(self.model.named_parameters()), "the rollout engine")
        return sorted(held) == sorted(hf) and all(torch.equal(held[name], hf[name]) for name in hf)

    def largest_difference(self, model) -> float:
        """The largest |engine - policy| over the policy's parameters (the same names in both): 0 where
        the stream is lossless, at most 2^-24 for a norm streamed as 1 + w (w' + 1 - 1 in fp32)."""
        engine, policy = dict(self.model.named_parameters()), dict(model.named_parameters())
        if sorted(engine) != sorted(policy):
            raise RuntimeError(f"the engine's parameters are not the policy's: {sorted(set(engine) ^ set(policy))[:3]}")
        return max(float((engine[name].detach() - value.detach()).abs().max()) for name, value in policy.items())

    def sample(self, every_prompt: list, step: int, mine: slice) -> Rollouts:
        """G sampled responses per prompt of this rank's share, drafted by the MTP depths (none: plain
        sampling), at temperature 1: the policy gradient's log pi is the model's own softmax (ratio 1)."""
        from megatron_mtp.serving import speculative

        args, stats, responses = self.args, speculative.Stats(depths=self.depths), []
        start = time.perf_counter()
        for p, prompt in enumerate(every_prompt[mine]):
            for g in range(args.group_size):
                key = (step * args.prompts_per_step + mine.start + p) * args.group_size + g  # unique per response
                choose = speculative.GumbelSampler(args.seed, key)
                responses.append(speculative.speculative(self.runner, prompt, self.task.answer_length, stats,
                                                         choose=choose, stop=EOS))
        seconds = time.perf_counter() - start
        return Rollouts(responses, Acceptance.of(stats) if self.depths else None, seconds)

    def engine_view(self, every_prompt: list, step: int, mine: slice) -> dict:
        """What a serving engine would see of the heads: one rejection-sampling decode of each prompt of
        this rank's share in each of vLLM's draft modes (probabilistic: drafts from q, accepted with
        min(1, p / q); greedy: drafts argmax q, accepted with p(argmax q)), at the rollouts' temperature
        1: an Acceptance per speculative.DRAFT_SAMPLE_METHODS name (none without heads). Their tokens are
        discarded, so the rollouts and the policy's trajectory stay the same whatever the heads are;
        their randomness is a stream of their own (keys after every rollout's, one range per mode)."""
        from megatron_mtp.serving import speculative

        if not self.depths:
            return {}
        args, view = self.args, {}
        offset = (args.steps + 1) * args.prompts_per_step * args.group_size  # beyond every rollout's key
        for mode, method in enumerate(speculative.DRAFT_SAMPLE_METHODS):
            stats = speculative.Stats(depths=self.depths)
            first_key = offset + mode * (args.steps + 1) * args.prompts_per_step
            for p, prompt in enumerate(every_prompt[mine]):
                key = first_key + step * args.prompts_per_step + mine.start + p
                sampler = speculative.RejectionSampler(args.seed, key, draft_sample_method=method)
                speculative.speculative(self.runner, prompt, self.task.answer_length, stats, choose=sampler, stop=EOS)
            view[method] = Acceptance.of(stats)
        return view

    def greedy_acceptance(self, prompts: list) -> Acceptance:
        """The decoder on the same prompts as vLLM's drafting engine (--rollouts plain): greedy, drafts
        chained as vLLM chains them (speculative.VllmDrafter)."""
        from megatron_mtp.serving import speculative

        stats = speculative.Stats(depths=self.depths)
        for prompt in prompts:
            speculative.speculative(self.runner, prompt, self.task.answer_length, stats, chain="vllm", stop=EOS)
        return Acceptance.of(stats)
