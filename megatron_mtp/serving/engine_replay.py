# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What an engine's verify steps should accept, predicted from the engine's own tokens.

The engine records every sampling step of a response (engines/vllm_probe.record_steps): the prefill's
token, then per verify step the drafts it verified and the tokens it emitted (the accepted drafts and
the token after them), before max_tokens cuts the response. `replay` runs the project's decoder
through those steps (speculative.speculative with a `Replay` as its sampler): the drafter chains its
drafts as vLLM does (speculative.VllmDrafter, or the trained chain), its inputs the tokens the engine
accepted, and the main head verifies them over its KV cache. At each depth k a step reached (every
draft before it accepted) the engine accepts its draft with probability

- alpha = sum_v min(p, q) with probabilistic drafts (spec section 12: d ~ q, accepted with min(1, p/q)),
- beta = p(argmax q) with greedy drafts (spec section 12.1: vLLM's default),

p the main head's softmax at the draft's position and q the drafter's, both at the temperature; both
are fixed by what the step saw before that draft. So over the steps that reached depth k, the engine's
accepted count minus the sum of these rates has mean 0 and variance sum rate (1 - rate) (a
martingale), whatever the text: the counts agree within a few standard errors exactly when the engine
verifies what the project's heads draft (Stats' drafted_* sums; `conditional acceptance z per depth`).
"""

import torch

from megatron_mtp.serving import speculative
from megatron_mtp.serving.speculative import RejectionSampler


class Replay(RejectionSampler):
    """A sampler for speculative.speculative that replays one response's recorded steps: its tokens are
    the engine's, and each verify step adds the rate of every depth it reached to `stats`."""

    def __init__(self, prompt: list[int], steps: list, stats: speculative.Stats, temperature: float,
                 draft_sample_method: str):
        super().__init__(seed=0, sequence=0, temperature=temperature, draft_sample_method=draft_sample_method)
        if not steps or steps[0][0] != 0 or len(steps[0][1]) != 1:
            raise ValueError("a response's steps begin with its prefill: no drafts, one token")
        self.steps, self.stats = [list(step) for step in steps], stats
        self.text = list(prompt) + [token for _, tokens in steps for token in tokens]
        self.next = 0  # the step to replay
        self.greedy_mismatches = 0  # greedy drafts the engine accepted that are not this chain's argmax

    @property
    def new_tokens(self) -> int:
        return sum(len(tokens) for _, tokens in self.steps)

    def _step(self, drafts: int) -> list[int]:
        verified, tokens = self.steps[self.next]
        if verified != drafts:
            raise ValueError(f"step {self.next} verified {verified} drafts, the decoder drafted {drafts}")
        self.next += 1
        return list(tokens)

    def __call__(self, logits: torch.Tensor, first_position: int) -> list[int]:
        return self._step(0)

    def draft(self, logits: torch.Tensor, first_position: int) -> list[int]:
        """The token the engine emitted at this position: where the engine accepted the draft, the draft
        itself; elsewhere a stand-in (no rate the replay records depends on it)."""
        position = first_position
        return [self.text[position]] if position < len(self.text) else logits.argmax(-1).tolist()

    def verify(self, logits: torch.Tensor, drafts: list[int], draft_logits: list, first_position: int) -> list[int]:
        emitted = self._step(len(drafts))
        accepted = len(emitted) - 1
        if not 0 <= accepted <= len(drafts) or emitted[:accepted] != drafts[:accepted]:
            raise ValueError(f"step {self.next - 1}: the engine emitted {emitted} for drafts {drafts}")
        target = self.probabilities(logits)
        for k in range(min(accepted + 1, len(drafts))):  # the depths this step reached
            chosen = int(draft_logits[k].argmax())  # the greedy draft of this chain
            self.greedy_mismatches += self.draft_sample_method == "greedy" and k < accepted and drafts[k] != chosen
            # sum_v min(p, q): alpha; with q one-hot at the greedy draft, p(argmax q): beta
            q = self.draft_distribution(draft_logits[k], chosen)
            self.stats.drafted(k, float(torch.minimum(target[k], q).sum()), accepted > k)
        return emitted


def replay(runner, prompt: list[int], steps: list, stats: speculative.Stats, temperature: float,
           draft_sample_method: str, chain: str = "vllm") -> Replay:
    """One response's recorded steps through the decoder (`chain`: speculative.CHAINS, vLLM's by default);
    the rates of the depths its verify steps reached go to `stats` (its drafted_* sums), the steps'
    own counts (verify steps, accepted per position) to the returned Replay's `counts`, as a decode
    counts them."""
    sampler = Replay(prompt, steps, stats, temperature, draft_sample_method)
    sampler.counts = speculative.Stats(depths=stats.depths)
    tokens = speculative.speculative(runner, prompt, sampler.new_tokens, sampler.counts, depths=stats.depths,
                                     choose=sampler, chain=chain)
    if sampler.next != len(steps) or tokens != sampler.text[len(prompt):]:
        raise ValueError(f"the replay took {sampler.next} of {len(steps)} steps")
    return sampler
