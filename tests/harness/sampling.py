# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Whether an engine's sampled tokens follow the project's own distribution: every token is scored by p, the
main head's softmax at its prefix (the project's model on the same weights), at the request's temperature
and with its top-p applied as vLLM applies it (`top_p_filter`). Two statistics, each exact when every token
was drawn from its p:

- the randomized probability integral transform u = P(X < x) + V p(x), V ~ U(0, 1) (the vocabulary in id
  order): independent and uniform on (0, 1) token after token, whatever the prefixes; `ks_p_value` tests
  their uniformity (Kolmogorov-Smirnov). It sees any difference between the sampled law and p.
- the calibration z = sum_t (log p_t(x_t) - E_{p_t} log p_t) / sqrt(sum_t Var_{p_t} log p_t): each term has
  mean 0 given the tokens before it (a martingale), so z is close to N(0, 1) over many tokens. It sees a
  wrong temperature at once (tokens too likely or too unlikely for p).
"""

import math

import torch


def top_p_filter(probabilities: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's top-p (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch): in ascending order,
    the tokens whose cumulative probability is at most 1 - top_p are dropped, the most likely one always
    kept; what is left is renormalized."""
    if top_p >= 1:
        return probabilities
    ordered, order = probabilities.sort(dim=-1)
    dropped = ordered.cumsum(-1) <= 1 - top_p
    dropped[..., -1] = False
    kept = probabilities.clone().scatter_(-1, order, ordered.masked_fill(dropped, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def scores(runner, prompt: list[int], output: list[int], temperature: float, top_p: float,
           generator: torch.Generator) -> tuple[list[float], float, float]:
    """Each output token's u; and over the output, sum (log p(x) - E log p) and sum Var log p."""
    _, logits = runner.main(torch.tensor([prompt + output]))
    rows = logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)].double()
    p = top_p_filter(torch.softmax(rows / temperature, -1), top_p)
    tokens = torch.tensor(output)
    chosen = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    below = torch.cumsum(p, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - chosen
    u = below + torch.rand(len(output), generator=generator, dtype=torch.float64) * chosen
    log_p = torch.where(p > 0, p.log(), torch.zeros_like(p))
    mean = (p * log_p).sum(-1)
    variance = (p * log_p ** 2).sum(-1) - mean ** 2
    return u.tolist(), float((chosen.log() - mean).sum()), float(variance.sum())


def ks_p_value(u: list[float]) -> float:
    """P(D_n >= d) for the Kolmogorov-Smirnov distance d of `u` from U(0, 1): the Kolmogorov law at
    sqrt(n) d with Stephens' small-sample correction (accurate to about 1% for n >= 35)."""
    n = len(u)
    ordered = sorted(u)
    d = max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(ordered))
    x = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    return max(0.0, min(1.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))))
