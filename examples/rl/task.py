# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A verifiable task for the RL example: reverse a string, rewarded exactly.

A prompt is BOS, L letters of an alphabet of A, then "="; the answer is the letters reversed,
then EOS (L + 1 tokens). A response ends at its first EOS (or after L + 1 tokens), so
responses differ in length. Its reward is the fraction of the answer's L + 1 tokens that the
response has at the same place: a rational number computed exactly from the tokens, so two
runs that sample the same tokens receive the same rewards.
"""

import torch

BOS, EQUALS, EOS = 0, 1, 2
FIRST_LETTER = 3


class Reversal:
    def __init__(self, length: int = 5, alphabet: int = 8):
        if length < 1 or alphabet < 2:
            raise ValueError(f"length {length} must be >= 1 and alphabet {alphabet} >= 2")
        self.length, self.alphabet = length, alphabet
        self.vocab_size = FIRST_LETTER + alphabet
        self.prompt_length = length + 2
        self.answer_length = length + 1
        self.sequence_length = self.prompt_length + self.answer_length  # tokens of prompt + answer

    def prompts(self, count: int, seed: int, step: int) -> list[list[int]]:
        """`count` prompts of one step, the same on every rank (seeded by the step)."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        letters = torch.randint(FIRST_LETTER, self.vocab_size, (count, self.length), generator=generator)
        return [[BOS, *row, EQUALS] for row in letters.tolist()]

    def answer(self, prompt: list[int]) -> list[int]:
        return prompt[1:-1][::-1] + [EOS]

    def reward(self, prompt: list[int], response: list[int]) -> float:
        answer = self.answer(prompt)
        if not 1 <= len(response) <= len(answer):
            raise ValueError(f"a response of {len(response)} tokens; the answer has {len(answer)}")
        return sum(r == a for r, a in zip(response, answer)) / len(answer)

    def text(self, tokens: list[int]) -> str:
        names = {BOS: "", EQUALS: "=", EOS: "$"}
        return "".join(names.get(t, chr(ord("a") + t - FIRST_LETTER)) for t in tokens)
