"""Greedy speculative decoding with the MTP depths as drafts, verified by the main head.

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

No KV cache: every forward runs over the whole sequence (CPU, small models). Statistics follow
vLLM's and SGLang's definitions (see `Stats`).
"""

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

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.depths
        self.teacher_forced_correct = self.teacher_forced_correct or [0] * self.depths
        self.teacher_forced_total = self.teacher_forced_total or [0] * self.depths

    def summary(self) -> dict:
        accepted = sum(self.accepted_per_position)
        drafts = max(self.drafts, 1)
        return {
            # vLLM: per-position acceptance rate = accepted at position k / number of drafts
            "acceptance per depth (vLLM per-position rate)": [a / drafts for a in self.accepted_per_position],
            # vLLM: draft acceptance rate = accepted draft tokens / drafted tokens
            "draft acceptance rate": accepted / max(self.drafts * self.depths, 1),
            # vLLM: mean acceptance length = 1 + accepted / drafts (the bonus token counted)
            "mean acceptance length incl. bonus (vLLM)": 1 + accepted / drafts,
            # SGLang: accept length = sum over verify steps of (accepted + 1) / verify steps
            "accept length incl. bonus (SGLang)": (accepted + self.drafts) / drafts,
            "target forwards per generated token": self.forwards / max(self.generated, 1),
            "teacher-forced acceptance per depth": [c / t if t else None for c, t in
                                                    zip(self.teacher_forced_correct, self.teacher_forced_total)],
            "verify steps": self.drafts, "target forwards": self.forwards, "generated tokens": self.generated,
        }


def greedy(runner, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding: one forward per token (the lossless reference)."""
    seq = list(prompt)
    for _ in range(new_tokens):
        _, logits = runner.main(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def draft(runner, hidden0: torch.Tensor, seq: list[int], depths: int) -> list[int]:
    """Depths 1..D drafting after `seq` (its last token the verified next token), from h^0 of seq[:-1]."""
    drafts = []
    hidden = hidden0  # [t + 1, 1, h]: positions 0..t, t = len(seq) - 2
    tokens = list(seq)
    length = hidden.shape[0]
    for k in range(1, depths + 1):
        ahead = torch.tensor([tokens[k: k + length]])  # x_{t'+k} for t' = 0..t
        hidden, logits = runner.depth(k, hidden, ahead)
        token = int(logits[0, -1].argmax())
        drafts.append(token)
        tokens.append(token)
    return drafts


def speculative(runner, prompt: list[int], new_tokens: int, stats: Stats, depths: int | None = None) -> list[int]:
    """Greedy decoding with MTP drafts; returns exactly `new_tokens` tokens."""
    depths = runner.depths if depths is None else depths
    # prefill: the first token is the main head's, then the first drafts
    hidden, logits = runner.main(torch.tensor([prompt]))
    stats.forwards += 1
    seq = list(prompt) + [int(logits[0, -1].argmax())]
    stats.generated += 1
    drafts = draft(runner, hidden, seq, depths) if depths else []
    while len(seq) - len(prompt) < new_tokens:
        hidden, logits = runner.main(torch.tensor([seq + drafts]))
        stats.forwards += 1
        stats.drafts += 1 if drafts else 0
        greedy_tokens = logits[0].argmax(-1).tolist()
        base = len(seq) - 1  # the last accepted position: its greedy token verifies d_1
        accepted = 0
        for j, token in enumerate(drafts):
            if token != greedy_tokens[base + j]:
                break
            accepted += 1
            stats.accepted_per_position[j] += 1
        seq += drafts[:accepted] + [greedy_tokens[base + accepted]]
        stats.generated += accepted + 1
        if depths:
            # h^0 of the accepted prefix (positions before the bonus) came with this forward
            drafts = draft(runner, hidden[: len(seq) - 1], seq, depths)
    return seq[len(prompt): len(prompt) + new_tokens]


def teacher_forced(runner, text: list[int], stats: Stats) -> None:
    """The trainer's acceptance on a text: argmax of depth k at t against the text's x_{t+k+1}."""
    tokens = torch.tensor([text])
    _, per_depth = runner.teacher_forced(tokens)
    for k, logits in enumerate(per_depth, start=1):
        targets = tokens[0, k + 1:]
        predicted = logits[0, : targets.shape[0]].argmax(-1)
        stats.teacher_forced_correct[k - 1] += int((predicted == targets).sum())
        stats.teacher_forced_total[k - 1] += int(targets.shape[0])
