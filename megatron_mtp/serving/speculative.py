# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Speculative decoding with the MTP depths as drafts, verified by the main head: greedy or sampled.

One step, with `seq` the accepted tokens (its last one the main head's own greedy token) and
the drafts d_1..d_D proposed after it:

1. verify: one target forward over seq + drafts; the main head's greedy token g at the last
   accepted position is the true next token; d_1 is accepted if it equals g, d_2 if it equals
   the main head's greedy token after d_1, and so on until the first mismatch; then the main
   head's token at that point (the bonus token) is appended. The output is greedy decoding's,
   token for token (lossless), whatever the drafts.
2. draft: at the last position t whose hidden state h^0_t belongs to the accepted prefix (the
   token before the bonus), depth 1 drafts x_{t+2} from h^0_t and the embedding of x_{t+1} (the
   bonus), depth k drafts x_{t+k+1} from h^{k-1}_t and the embedding of depth k-1's draft:
   the chain the depths were trained on (spec section 1), fed the accepted prefix.

Every forward runs only its new positions over the Runner's KV cache: the verify step the
accepted token and the drafts, each depth the positions whose hidden state it has not yet taken
for good. Depth k's state at position t is final once x_{t+k}, its input token, is accepted
(t <= n - 1 - k for n accepted tokens); the positions after that ran on drafts and run again
next step, as a whole-sequence recompute would run them (tests/reference/speculative.py is that
recompute; the tests compare the two). Statistics follow vLLM's and SGLang's definitions (see
`Stats`).

Which token a head's logits give is the `choose` function's: `greedy_choice` (argmax), or a
`GumbelSampler`, which samples position p's token as argmax(logits / T + g_p) with Gumbel noise
g_p drawn from a stream keyed by (seed, sequence, p). The noise depends on the position alone,
never on what was drafted, so speculative sampling returns exactly the tokens that plain
sampling with the same key returns (lossless token for token, not only in distribution), and a
draft drawn with the same noise is accepted whenever the depth's perturbed argmax is the main
head's. An RL loop's rollouts are therefore the same with or without drafts
(examples/rl/rollout.py).

Or a `RejectionSampler`, the engines' sampler (vLLM's v1 rejection sampler, Leviathan et al.,
arXiv 2211.17192): each depth draws its draft d from q = softmax(depth logits / T); the verifier
accepts d with probability min(1, p(d) / q(d)), p = softmax(main logits / T) at that position,
and at the first rejection emits a token drawn from norm(max(0, p - q)) (the recovered token) and
stops; with every draft accepted it emits a token drawn from p after them (the bonus token). The
output has plain sampling's distribution (lossless in distribution, not token for token: the two
draw their randomness differently), and a draft is accepted with probability sum_v min(p, q).
That is vLLM's opt-in draft_sample_method="probabilistic"; its default, "greedy" (spec section
12.1), drafts d = argmax q and takes q as one-hot: the same rule then accepts d with probability
p(d), recovers from norm(max(0, p - onehot(d))) (p without d), and the output has plain sampling's
distribution as well.
"""

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class Stats:
    depths: int
    drafts: int = 0  # verification steps that carried drafts (vLLM's num_drafts)
    accepted_per_position: list = field(default_factory=list)  # [D]: drafts accepted at position k
    forwards: int = 0  # target forward passes (verification steps, the prefill included)
    generated: int = 0  # tokens emitted (bonus tokens included)
    teacher_forced_correct: list = field(default_factory=list)
    teacher_forced_total: list = field(default_factory=list)
    teacher_forced_overlap: list = field(default_factory=list)  # sums of sum_v min(p, q)
    teacher_forced_greedy: list = field(default_factory=list)  # sums of p(argmax q) (1[argmax q = argmax p] at T 0)
    # sums of prod_{i<=k} over the depths at each anchor of the two above (chained drafts)
    teacher_forced_overlap_chain: list = field(default_factory=list)
    teacher_forced_greedy_chain: list = field(default_factory=list)
    sampled: bool = False  # teacher_forced measured sum_v min(p, q) (a temperature given)
    # sums over the verify steps that reached depth k (`drafted`): those steps, their drafts accepted
    # at k, and the probability each had to be accepted there (sum_v min(p, q); greedy drafts:
    # p(argmax q)) with its Bernoulli variance rate (1 - rate)
    drafted_reached: list = field(default_factory=list)
    drafted_accepted: list = field(default_factory=list)
    drafted_overlap: list = field(default_factory=list)
    drafted_variance: list = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.depths
        self.teacher_forced_correct = self.teacher_forced_correct or [0] * self.depths
        self.teacher_forced_total = self.teacher_forced_total or [0] * self.depths
        for name in ("teacher_forced_overlap", "teacher_forced_greedy", "teacher_forced_overlap_chain",
                     "teacher_forced_greedy_chain"):
            setattr(self, name, getattr(self, name) or [0.0] * self.depths)
        for name in ("drafted_reached", "drafted_accepted", "drafted_overlap", "drafted_variance"):
            setattr(self, name, getattr(self, name) or [0] * self.depths)

    def drafted(self, depth: int, rate: float, accepted: bool) -> None:
        """A verify step reached `depth` (0-based: its drafts before it accepted), whose draft it accepted
        with probability `rate`, and `accepted` it or not."""
        self.drafted_reached[depth] += 1
        self.drafted_accepted[depth] += int(accepted)
        self.drafted_overlap[depth] += rate
        self.drafted_variance[depth] += rate * (1 - rate)

    def add_counts(self, other: "Stats") -> None:
        """Another decode's counts (verify steps, accepted per position, forwards, tokens) added to these."""
        self.drafts += other.drafts
        self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position,
                                                            strict=True)]
        self.forwards += other.forwards
        self.generated += other.generated

    def summary(self) -> dict:
        accepted = sum(self.accepted_per_position)
        drafts = max(self.drafts, 1)
        return {
            # vLLM: per-position acceptance rate = accepted at position k / number of drafts
            "acceptance per depth (vLLM per-position rate)": [a / drafts for a in self.accepted_per_position],
            # vLLM: draft acceptance rate = accepted draft tokens / drafted tokens
            "draft acceptance rate": accepted / max(self.drafts * self.depths, 1),
            # tokens emitted per verify step, the bonus token counted: vLLM's mean acceptance length
            # (1 + accepted / drafts) and SGLang's accept length (sum of accepted + 1 over verify steps,
            # divided by their number) are this one number whenever every verify step carries drafts
            "mean acceptance length incl. bonus": 1 + accepted / drafts,
            "target forwards per generated token": self.forwards / max(self.generated, 1),
            # accepted at depth k / verify steps that reached depth k (every draft before it accepted):
            # a rejection sampler accepts it with probability sum_v min(p, q), which the trainer's
            # teacher-forced `mtp_k sampled acceptance` averages over the text's positions (spec section 12)
            "conditional acceptance per depth": [a / reached if reached else None for a, reached in
                                                 zip(self.accepted_per_position,
                                                     [self.drafts] + self.accepted_per_position[:-1], strict=True)],
            "teacher-forced acceptance per depth": [c / t if t else None for c, t in
                                                    zip(self.teacher_forced_correct, self.teacher_forced_total)],
            # spec section 12's `mtp_k sampled acceptance` on the same texts (teacher_forced with a temperature)
            "teacher-forced sampled acceptance per depth": [
                a / t if t and self.sampled else None
                for a, t in zip(self.teacher_forced_overlap, self.teacher_forced_total, strict=True)],
            # spec section 12.1's `mtp_k greedy-draft acceptance`: what vLLM's default greedy drafts are
            # accepted with (p(argmax q) at the temperature; at temperature 0, argmax q = argmax p)
            "teacher-forced greedy-draft acceptance per depth": [
                a / t if t else None
                for a, t in zip(self.teacher_forced_greedy, self.teacher_forced_total, strict=True)],
            # 1 + sum_j mean_t prod_{i<=j}: the chained drafts' expected tokens per verify step, the bonus counted
            "teacher-forced expected accepted length (sampling)":
                1 + sum(a / t for a, t in zip(self.teacher_forced_overlap_chain, self.teacher_forced_total,
                                              strict=True) if t) if self.sampled else None,
            "teacher-forced expected accepted length (greedy drafts)":
                1 + sum(a / t for a, t in zip(self.teacher_forced_greedy_chain, self.teacher_forced_total,
                                              strict=True) if t),
            # `drafted`'s sums: the mean of sum_v min(p, q) (greedy drafts: of p(argmax q)) at the
            # positions the verify steps drafted at, each depth over the steps that reached it (what its
            # conditional acceptance estimates there), and how many standard errors the accepted count
            # lies from it
            "accepted per position": list(self.accepted_per_position),
            "expected accepted per position": list(self.drafted_overlap) if any(self.drafted_reached) else None,
            "expected conditional acceptance per depth": [
                o / n if n else None for o, n in zip(self.drafted_overlap, self.drafted_reached, strict=True)],
            "conditional acceptance z per depth": [
                (a - o) / v ** 0.5 if v > 0 else None
                for a, o, v in zip(self.drafted_accepted, self.drafted_overlap, self.drafted_variance, strict=True)],
            "verify steps": self.drafts, "target forwards": self.forwards, "generated tokens": self.generated,
        }


def greedy_choice(logits: torch.Tensor, first_position: int) -> list[int]:
    """The tokens of logits rows [n, V] at positions first_position .. + n - 1: their argmax."""
    return logits.argmax(-1).tolist()


class GumbelSampler:
    """Samples from softmax(logits / temperature) by the Gumbel-max trick, the noise of each
    position drawn from its own stream keyed by (seed, sequence, position): a token depends on
    its position's logits and key only."""

    def __init__(self, seed: int, sequence: int, temperature: float = 1.0):
        if temperature <= 0:
            raise ValueError(f"temperature {temperature} must be > 0 (greedy_choice is temperature 0)")
        self.seed, self.sequence, self.temperature = seed, sequence, temperature

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, self.sequence, position)) % 2**63)
        uniform = torch.rand(vocab, generator=generator, dtype=torch.float64).clamp_(min=1e-300)
        return -torch.log(-torch.log(uniform))

    def __call__(self, logits: torch.Tensor, first_position: int) -> list[int]:
        rows = logits.double() / self.temperature
        return [int((row + self.noise(first_position + i, row.numel()).to(row.device)).argmax())
                for i, row in enumerate(rows)]


def match(choose, logits: torch.Tensor, drafts: list[int], draft_logits: list, first_position: int) -> list[int]:
    """Greedy and Gumbel verification: the drafts up to the first that differs from the main head's
    own token at its position, then the main head's token there (the bonus token)."""
    chosen = choose(logits, first_position)
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == chosen[accepted]:
        accepted += 1
    return drafts[:accepted] + [chosen[accepted]]


DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")  # vLLM's speculative_config draft_sample_method values


def check_draft_sample_method(name: str) -> None:
    if name not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method {name!r} is not one of {', '.join(DRAFT_SAMPLE_METHODS)}")


class RejectionSampler:
    """Samples from softmax(logits / temperature) (plain decoding, the prefill's token) and
    verifies drafts by rejection sampling (`verify`), its randomness one stream keyed by (seed,
    sequence). Drafts (`draft`) are sampled from the depth's softmax (``probabilistic``) or are its
    argmax, the lowest token id on ties (``greedy``: vLLM's default), verified as one-hot."""

    def __init__(self, seed: int, sequence: int, temperature: float = 1.0, draft_sample_method: str = "probabilistic"):
        if temperature <= 0:
            raise ValueError(f"temperature {temperature} must be > 0 (greedy_choice is temperature 0)")
        check_draft_sample_method(draft_sample_method)
        self.temperature, self.draft_sample_method = temperature, draft_sample_method
        self.generator = torch.Generator().manual_seed(hash((seed, sequence)) % 2**63)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.double().cpu() / self.temperature, dim=-1)

    def sample(self, weights: torch.Tensor) -> int:
        """A token drawn with probability proportional to `weights` (non-negative, [V])."""
        return int(torch.multinomial(weights, 1, generator=self.generator))

    def __call__(self, logits: torch.Tensor, first_position: int) -> list[int]:
        return [self.sample(row) for row in self.probabilities(logits)]

    def draft(self, logits: torch.Tensor, first_position: int) -> list[int]:
        """The drafts of depth logits rows [n, V]."""
        if self.draft_sample_method == "greedy":
            return greedy_choice(logits, first_position)
        return self(logits, first_position)

    def draft_distribution(self, row: torch.Tensor, draft: int) -> torch.Tensor:
        """q, the distribution the verifier takes `draft` to be drawn from: the depth's softmax, or
        one-hot at the greedy draft."""
        if self.draft_sample_method == "greedy":
            return torch.zeros(row.numel(), dtype=torch.float64).index_fill_(0, torch.tensor(draft), 1.0)
        return self.probabilities(row)

    def verify(self, logits: torch.Tensor, drafts: list[int], draft_logits: list, first_position: int) -> list[int]:
        """The tokens a verify step emits: logits [n + 1, V] are the main head's at the positions of
        the n drafts and after them, draft_logits the n rows each draft was drawn from (or is the
        argmax of). Greedy drafts: q one-hot, so d is accepted with probability p(d) and a rejection
        draws from p without d."""
        if not len(logits) == len(drafts) + 1 == len(draft_logits) + 1:
            raise ValueError(f"{len(logits)} target rows for {len(drafts)} drafts and {len(draft_logits)} draft rows")
        target = self.probabilities(logits)
        emitted = []
        for p, draft, row in zip(target[:-1], drafts, draft_logits, strict=True):
            q = self.draft_distribution(row, draft)
            uniform = torch.rand((), generator=self.generator, dtype=torch.float64)
            if q[draft] > 0 and p[draft] / q[draft] >= uniform:  # accepted with probability min(1, p / q)
                emitted.append(draft)
                continue
            residual = (p - q).clamp(min=0)
            # a rejection needs p(d) < q(d) <= 1, so p - q has mass elsewhere unless round-off took it all
            return emitted + [self.sample(residual if residual.sum() > 0 else p)]
        return emitted + [self.sample(target[-1])]  # every draft accepted: the bonus token


def greedy(runner, prompt: list[int], new_tokens: int, choose=greedy_choice, stop: int | None = None) -> list[int]:
    """Plain decoding: one forward of one new token per token (the lossless reference); it ends
    after `new_tokens` tokens, or with the first `stop` token."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens {new_tokens} must be >= 1")
    _, logits = runner.main(torch.tensor([prompt]))
    seq = list(prompt) + choose(logits[0, -1:], len(prompt))
    while len(seq) - len(prompt) < new_tokens and seq[-1] != stop:
        _, logits = runner.main(torch.tensor([seq[-1:]]), start=len(seq) - 1)
        seq += choose(logits[0, -1:], len(seq))
    return seq[len(prompt):]


class Drafter:
    """The depths' final hidden states: final[j] holds h^j [P_j, 1, h] of positions 0 .. P_j - 1 that
    will not change (final[0]: the main head's over the accepted prefix), so that each depth runs
    from P_k on, over its KV cache of the positions before."""

    def __init__(self, runner, depths: int, choose=greedy_choice):
        self.runner, self.depths, self.choose = runner, depths, choose
        self.final = [None] * (depths + 1)
        self.logits = []  # each draft's logits row [V] of the last draft(): the verifier's q

    def accept(self, hidden0: torch.Tensor) -> None:
        """h^0 of accepted positions following those already held."""
        held = self.final[0]
        self.final[0] = hidden0 if held is None else torch.cat([held, hidden0])

    def draft(self, seq: list[int]) -> list[int]:
        """Depths 1..D drafting after `seq` (its last token the verified next token), at t = len(seq) - 2."""
        t = len(seq) - 2
        tokens = list(seq)
        drafts = []
        tail = None  # h^{k-1} of the positions after final[k-1], from this step (they read drafts)
        self.logits = []
        for k in range(1, self.depths + 1):
            held = self.final[k]
            start = 0 if held is None else held.shape[0]
            below = self.final[k - 1][start:]
            inputs = below if tail is None else torch.cat([below, tail])  # positions start .. t
            ahead = torch.tensor([tokens[start + k: t + 1 + k]])  # x_{t'+k}
            hidden, logits = self.runner.depth(k, inputs, ahead, start=start)
            [token] = self.choose(logits[0, -1:], t + k + 1)  # depth k at t drafts x_{t+k+1}
            drafts.append(token)
            self.logits.append(logits[0, -1])
            tokens.append(token)
            settled = max(start, min(t + 1, len(seq) - k)) - start  # positions whose x_{t'+k} is accepted
            self.final[k] = hidden[:settled] if held is None else torch.cat([held, hidden[:settled]])
            tail = hidden[settled:]
        return drafts


class VllmDrafter(Drafter):
    """The drafts as vLLM 0.32 chains them (read in vllm/v1/spec_decode/llm_base_proposer.py `propose`,
    vllm/model_executor/models/mimo_mtp.py; counts checked against the engine, tests/test_engine.py),
    where they differ from the trained chain (Drafter):

    - one MTP layer runs at every draft step: the proposer passes no step index, so the draft model's
      first layer (depth 1's) drafts token t+k+1 too;
    - one KV cache for it: the first step runs depth 1 over the accepted positions s .. t (its cache
      keeps positions < s from earlier steps); step k >= 2 runs at position t + k - 1 on the previous
      step's output there (its final_layernorm(h), as trained) and the previous draft, attending to
      depth 1's keys at positions <= t and this step's chain before it (where the trained depth k
      attends to depth k's own states at positions <= t, at position t);
    - the token embedding at position 0 is zero (MiMo's MTP masks it: `positions == 0`);
    - the first step takes the main model's states before its final norm (vLLM's MiMoModel returns
      them so and applies the norm in compute_logits), where megatron-core trains the depths on the
      states after it (the main head's input).
    """

    def accept(self, hidden0: torch.Tensor) -> None:
        # the same positions of the main model's last forward, before its final norm (Runner.pre_norm)
        super().accept(self.runner.pre_norm[: hidden0.shape[0]])

    def draft(self, seq: list[int]) -> list[int]:
        t = len(seq) - 2
        held = self.final[1]
        start = 0 if held is None else held.shape[0]
        hidden, logits = self.runner.depth(1, self.final[0][start:], torch.tensor([seq[start + 1: t + 2]]),
                                           start=start, zero_position_0=True)
        self.final[1] = hidden if held is None else torch.cat([held, hidden])  # x_{t'+1} accepted for t' <= t
        drafts, self.logits = [], []
        for k in range(1, self.depths + 1):
            if k > 1:  # the chain: one position on, the previous step's output and draft as inputs
                hidden, logits = self.runner.depth(1, hidden[-1:], torch.tensor([drafts[-1:]]), start=t + k - 1)
            [token] = self.choose(logits[0, -1:], t + k + 1)
            drafts.append(token)
            self.logits.append(logits[0, -1])
        return drafts


CHAINS = {"trained": Drafter, "vllm": VllmDrafter}


def speculative(runner, prompt: list[int], new_tokens: int, stats: Stats, depths: int | None = None,
                choose=greedy_choice, stop: int | None = None, steps: list | None = None,
                chain: str = "trained", draft_logits: list | None = None) -> list[int]:
    """Decoding with MTP drafts; returns the tokens of `greedy(..., choose, stop)` (with a
    RejectionSampler: tokens of their distribution): `new_tokens` of them, or fewer ending with the
    first `stop` token. A verify step's tokens after a stop token or beyond `new_tokens` are
    dropped: `generated` counts what is returned, the acceptance counters the verifier's verdict
    on every draft it checked (vLLM's counting). A `steps` list receives every sampling step as an
    engine records it (engines/vllm_probe.record_steps): [drafts verified, [tokens emitted]], the
    prefill's [0, [token]] first, each verify step's tokens before `new_tokens` or `stop` cut them
    (engine_replay.replay reads them).
    `chain`: how the drafts are chained (CHAINS): as trained (Drafter), or as vLLM runs them (VllmDrafter).
    A `draft_logits` list receives each drafting's logits [depths, V] (the rows the drafts were chosen from)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens {new_tokens} must be >= 1")
    rejection = isinstance(choose, RejectionSampler)
    verify = choose.verify if rejection else functools.partial(match, choose)
    depths = runner.depths if depths is None else depths
    drafter = CHAINS[chain](runner, depths, choose.draft if rejection else choose)
    # prefill: the first token is the main head's, then the first drafts
    hidden, logits = runner.main(torch.tensor([prompt]))
    stats.forwards += 1
    seq = list(prompt) + choose(logits[0, -1:], len(prompt))
    stats.generated += 1
    if steps is not None:
        steps.append([0, seq[-1:]])
    if seq[-1] == stop or new_tokens == 1:
        return seq[len(prompt):]
    drafter.accept(hidden)

    def draft() -> list[int]:
        drafts = drafter.draft(seq) if depths else []
        if draft_logits is not None and drafts:
            draft_logits.append(torch.stack(drafter.logits))
        return drafts

    drafts = draft()
    while len(seq) - len(prompt) < new_tokens:
        base = len(seq) - 1  # the last accepted position: its greedy token verifies d_1
        hidden, logits = runner.main(torch.tensor([seq[-1:] + drafts]), start=base)
        stats.forwards += 1
        stats.drafts += 1 if drafts else 0
        # the main head's rows at each position after base verify the drafts
        emitted = verify(logits[0], drafts, drafter.logits, base + 1)
        accepted = len(emitted) - 1
        for j in range(accepted):  # the verifier's verdict on each draft, as vLLM counts it
            stats.accepted_per_position[j] += 1
        if steps is not None:
            steps.append([len(drafts), list(emitted)])
        emitted = emitted[: new_tokens - (len(seq) - len(prompt))]  # the last step: what is asked for
        if stop in emitted:  # the sequence ends there
            emitted = emitted[: emitted.index(stop) + 1]
        seq += emitted
        stats.generated += len(emitted)
        if seq[-1] == stop or len(seq) - len(prompt) == new_tokens:  # done: nothing more to draft
            break
        drafter.accept(hidden[: accepted + 1])  # h^0 of the accepted prefix (positions before the bonus)
        drafts = draft()
    return seq[len(prompt):]


def sampled_overlap(main: torch.Tensor, logits: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """sum_v min(p, q) at each position t whose target x_{t+k+1} the text holds (spec section 12):
    p the main head's softmax at t + k, q depth k's at t, both at `temperature`; main and logits
    are a text's teacher-forced rows [1, n, V] (Runner.teacher_forced)."""
    count = main.shape[1] - k - 1
    p = torch.softmax(main[0, k: k + count].double() / temperature, -1)
    q = torch.softmax(logits[0, :count].double() / temperature, -1)
    return torch.minimum(p, q).sum(-1)


def greedy_draft_acceptance(main: torch.Tensor, logits: torch.Tensor, k: int,
                            temperature: float | None) -> torch.Tensor:
    """p(argmax q) at each position t whose target x_{t+k+1} the text holds (spec section 12.1): what
    a greedy draft (depth k's argmax at t, the lowest id on ties) is accepted with, p the main
    head's softmax at t + k at `temperature`; None (greedy decoding): 1 where the draft is the
    main head's argmax there, else 0. main and logits as for `sampled_overlap`."""
    count = main.shape[1] - k - 1
    target = main[0, k: k + count].double()
    drafts = logits[0, :count].argmax(-1)
    if temperature is None:
        return (drafts == target.argmax(-1)).double()
    return torch.softmax(target / temperature, -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)


def teacher_forced(runner, text: list[int], stats: Stats, temperature: float | None = None) -> None:
    """The trainer's acceptance on a text: argmax of depth k at t against the text's x_{t+k+1}; its
    greedy-draft acceptance (spec section 12.1: p(argmax q), at temperature 0 whether argmax q is
    the main head's argmax); with a temperature also its sampled acceptance (spec section 12):
    sum_v min(p, q), p the main head's softmax at t + k and q depth k's at t, both at that
    temperature. Each also as chains: at anchor t, the product over depths 1..k."""
    tokens = torch.tensor([text])
    main, per_depth = runner.teacher_forced(tokens, depths=stats.depths)  # the depths drafting, not every depth
    stats.sampled |= temperature is not None
    greedy_chain = sampled_chain = None
    for k, logits in enumerate(per_depth, start=1):
        targets = tokens[0, k + 1:]
        predicted = logits[0, : targets.shape[0]].argmax(-1)
        stats.teacher_forced_correct[k - 1] += int((predicted == targets).sum())
        stats.teacher_forced_total[k - 1] += int(targets.shape[0])
        greedy = greedy_draft_acceptance(main, logits, k, temperature)
        greedy_chain = greedy if greedy_chain is None else greedy_chain[: greedy.shape[0]] * greedy
        stats.teacher_forced_greedy[k - 1] += float(greedy.sum())
        stats.teacher_forced_greedy_chain[k - 1] += float(greedy_chain.sum())
        if temperature is not None:
            sampled = sampled_overlap(main, logits, k, temperature)
            sampled_chain = sampled if sampled_chain is None else sampled_chain[: sampled.shape[0]] * sampled
            stats.teacher_forced_overlap[k - 1] += float(sampled.sum())
            stats.teacher_forced_overlap_chain[k - 1] += float(sampled_chain.sum())
