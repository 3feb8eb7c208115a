# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Pearson's chi-square goodness-of-fit test for the samplers' distribution tests: its statistic,
its critical value at a significance level (the chi-square distribution's, through torch's
regularized incomplete gamma function; the environment has no scipy) and its power against a
stated alternative distribution (the fraction of multinomial samples of the alternative that the
test rejects, from a fixed seed)."""

import torch


def statistic(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """sum (observed - expected)^2 / expected over the categories."""
    expected = counts.sum() * probabilities.double()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def pool(probabilities: torch.Tensor, samples: int, smallest: float = 5.0) -> torch.Tensor:
    """Each category's index after the categories expected fewer than `smallest` times in `samples`
    draws are pooled into one (the last), so that every expected count is at least `smallest`, as
    the chi-square law of the statistic needs; pooled(x) = torch.zeros(n).index_add_(0, pool, x)."""
    small = probabilities * samples < smallest
    index = torch.cumsum(~small, 0) - 1
    index[small] = int((~small).sum())
    if float(probabilities[small].sum()) * samples < smallest and bool(small.any()):
        raise ValueError(f"the categories expected fewer than {smallest} times hold too little together; draw more")
    return index


def pooled(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(index.max()) + 1, dtype=values.dtype).index_add_(0, index, values)


def critical_value(df: int, level: float) -> float:
    """x with P(chi2_df > x) = level, by bisection."""
    df, low, high = torch.tensor(df / 2, dtype=torch.float64), 0.0, 1.0
    while float(torch.special.gammaincc(df, torch.tensor(high / 2, dtype=torch.float64))) > level:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        above = float(torch.special.gammaincc(df, torch.tensor(middle / 2, dtype=torch.float64))) > level
        low, high = (middle, high) if above else (low, middle)
    return high


def power(null: torch.Tensor, alternative: torch.Tensor, samples: int, level: float, draws: int = 2000,
          seed: int = 0) -> float:
    """P(the test at `level` rejects `null`) when `samples` observations come from `alternative`."""
    if null.shape != alternative.shape:
        raise ValueError(f"null {tuple(null.shape)} and alternative {tuple(alternative.shape)} differ in categories")
    threshold = critical_value(null.numel() - 1, level)
    generator = torch.Generator().manual_seed(seed)
    rejected = 0
    for _ in range(draws):
        drawn = torch.multinomial(alternative.double(), samples, replacement=True, generator=generator)
        rejected += statistic(torch.bincount(drawn, minlength=null.numel()), null) > threshold
    return rejected / draws
