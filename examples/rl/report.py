# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The RL example's report: one line per RL step in the trainer's console format (rank 0;
tools/plot_runs.py reads it), from the step's records summed over the ranks; --out DIR keeps the
lines in console.log.

A line holds, in this order: consumed samples, reward, solved; the acceptance of each decode that
drafted, per depth (mtp_k ... acceptance: the per-position rate, verify steps that accepted depth k's
draft over all verify steps, vLLM's counting) with its mean acceptance length (incl. bonus): the
decoder's rollouts (rollout), vLLM's speculative rollouts (vllm), the decoder's engine view in both
of vLLM's draft modes (engine; engine ... (greedy drafts)), and with --rollouts plain vLLM's greedy
decode and the decoder's beside it (vllm greedy, decoder greedy); then the step's policy-gradient
loss, each depth's loss and teacher-forced acceptances (top-1, sampled, greedy-draft), its
load-balancing loss where it has experts, the grad norms, and the rollout time.
"""

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from .rollout import Acceptance, Rollouts
from .step import StepMetrics, all_sum

# the engine view's names by vLLM draft_sample_method: the probabilistic mode's keep their first names
ENGINE_NOTES = {"probabilistic": "", "greedy": " (greedy drafts)"}


@dataclass
class StepReport:
    """What one RL step prints, every count summed over the ranks."""

    consumed: int  # responses sampled so far
    reward: float  # the mean reward
    solved: float  # the fraction of responses with reward 1
    rollouts: Acceptance | None  # the decoder's rollouts (Gumbel-coupled)
    vllm: Acceptance | None  # vLLM's speculative rollouts, as the engine counted them
    engine: dict  # the decoder's engine view: an Acceptance per draft mode (none without heads)
    vllm_greedy: Acceptance | None  # --rollouts plain: vLLM's greedy decode of every prompt
    decoder_greedy: Acceptance | None  # and the decoder's, vLLM's draft chain
    metrics: StepMetrics
    rollout_seconds: float
    per_rank: bool  # the decoder's: every rank sampled its share (the mean); vLLM's: rank 0's engine

    @classmethod
    def over_ranks(cls, consumed: int, rewards: list[float], rollouts: Rollouts, engine: str, view: dict,
                   greedy: tuple | None, metrics: StepMetrics) -> "StepReport":
        """This rank's records (`engine`: decoder or vllm; `greedy`: vLLM's greedy decode and the
        decoder's, or None), summed over the ranks (collectives: every rank calls it)."""
        total, count, solved = all_sum([sum(rewards), len(rewards), sum(r == 1.0 for r in rewards)])
        counted = rollouts.acceptance.summed() if rollouts.acceptance is not None else None
        view = {method: acceptance.summed() for method, acceptance in view.items()}
        vllm_greedy, decoder_greedy = (acceptance.summed() for acceptance in greedy) if greedy else (None, None)
        [seconds] = all_sum([rollouts.seconds])
        decoder = engine == "decoder"
        return cls(consumed, total / count, solved / count, counted if decoder else None,
                   None if decoder else counted, view, vllm_greedy, decoder_greedy, metrics,
                   seconds / dist.get_world_size() if decoder else seconds, decoder)

    def fields(self):
        """(console name, value), in the line's order."""
        yield "consumed samples", self.consumed
        yield "reward", self.reward
        yield "solved", self.solved
        decodes = [("rollout", "", self.rollouts), ("vllm", "", self.vllm),
                   *(("engine", ENGINE_NOTES[method], acceptance) for method, acceptance in self.engine.items()),
                   ("vllm greedy", "", self.vllm_greedy), ("decoder greedy", "", self.decoder_greedy)]
        for label, note, acceptance in decodes:
            if acceptance is not None:
                for k, rate in enumerate(acceptance.rates(), 1):
                    yield f"mtp_{k} {label} acceptance{note}", rate
                yield f"{label} mean acceptance length (incl. bonus){note}", acceptance.mean_length()
        yield "policy-gradient loss", self.metrics.main_loss
        for k, head in enumerate(self.metrics.heads, 1):
            yield f"mtp_{k} loss", head.loss
            yield f"mtp_{k} acceptance", head.acceptance
            yield f"mtp_{k} sampled acceptance", head.sampled_acceptance
            yield f"mtp_{k} greedy-draft acceptance", head.greedy_draft_acceptance
            if head.load_balancing_loss is not None:
                yield f"mtp_{k} load balancing loss", head.load_balancing_loss
        yield "grad norm", self.metrics.grad_norm
        if self.metrics.mtp_grad_norm is not None:
            yield "mtp grad norm", self.metrics.mtp_grad_norm
        yield "rollout seconds per rank" if self.per_rank else "rollout seconds", self.rollout_seconds

    def line(self, step: int, steps: int) -> str:
        text = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {step:8d}/{steps:8d} |"
        return text + "".join(f" {name}: {value:.6g} |" for name, value in self.fields())


class Console:
    """Rank 0's lines, to stdout and with --out to console.log."""

    def __init__(self, out: Path | None, task):
        self.log = None
        if out is not None and dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            self.log = open(out / "console.log", "w")
            # upstream's argument dump format: tools/plot_runs.py counts tokens with it
            self.log.write(f"  seq_length ........ {task.sequence_length - 1}\n")

    def write(self, line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)
            if self.log:
                self.log.write(line + "\n")
                self.log.flush()

    def close(self) -> None:
        if self.log:
            self.log.close()
