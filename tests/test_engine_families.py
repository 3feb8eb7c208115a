# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Every family's export in vLLM's CPU build (megatron_mtp.serving.engines.vllm_engine), against the
project's decoder: a tiny random model of the family (tests/bodies/engine_families.py: transformers'
model imported with one new MTP depth, exported as the family as written, in the dtype the CPU kernels
take; DeepSeek-V3's and the Gated DeltaNet families' trained by the project's trainer on the
embedded corpus instead, and prompted from it), decoded greedily by the project (tests.bodies.engine)
and by vLLM, one request per prompt.
vLLM's plain tokens = the project's; where vLLM has an MTP model for the family's layout, its
speculative tokens at D = 1 = its plain ones, and its verify steps and accepted drafts = the
project's with vLLM's draft chain (at D = 1 both chains are one), prompt by prompt, where the
project's decisions are clear of the engine's round-off (the margin filter of tests/test_engine.py,
the dtype's: bf16 engines compute in bf16 on the same bf16 weights).
"""

import json
import random

import pytest

from megatron_mtp.serving import families
from megatron_mtp.serving.engines import vllm_engine
from tests.bodies import engine_families
from tests.harness import corpora
from tests.harness.launcher import launch

PROMPTS, PROMPT_LENGTH, NEW_TOKENS = 16, 12, 8
# logits: fp32 as tests/test_engine.py; bf16's rounding (2^-8 relative) on logits of |l| <= ~3 is ~1e-2,
# where the engine's bf16 tokens were seen to part from the project's fp32 ones (at margins <= 0.0084). The
# random Gated DeltaNet models' logits reach 5-8 (the (1 + w) norms at w ~ 1 double them), where one bf16
# step is 2^-5: whether they passed at this margin hung on the initialization (so they are trained)
MARGIN = {"fp32": 1e-2, "bf16": 2e-2}
# prompts that must be clear of round-off: these random models' logits are small (GLM-4.5's: 5 of 16 in fp32)
KEPT = {"fp32": PROMPTS // 4, "bf16": PROMPTS // 4}
ENGINE_TIMEOUT = 300


def prompts(trained: bool) -> list:
    """A trained model's from its corpus, a random model's random."""
    if trained:
        return corpora.corpus_prompts(PROMPTS, PROMPT_LENGTH, NEW_TOKENS)
    draw = random.Random(11)
    return [[draw.randrange(engine_families.VOCAB) for _ in range(PROMPT_LENGTH)] for _ in range(PROMPTS)]


# The project's chain that drafts as the family's vLLM MTP model does at D = 1: vLLM's MiMo MTP
# (speculative.VllmDrafter) takes the main model's states before its final norm, Qwen3-Next's,
# Qwen3.5's, DeepSeek's and GLM's take them after it, as the depths were trained (DeepSeek's and GLM's also zero
# the embedding at position 0, which only the draft's attention to position 0 sees)
CHAIN = {"MiMoMTP": "vllm"}


# matrix: each family costs 50-150 s here (an import or a training run, an export, a decode, one or two engine
# starts), the trained ones 90-350 s each
@pytest.fixture(scope="module", params=[pytest.param(family, marks=pytest.mark.matrix)
                                        for family in engine_families.FAMILIES])
def runs(request, tmp_path_factory):
    family = request.param
    if not vllm_engine.available():
        pytest.fail(f"no vLLM at {vllm_engine.python()}: run `bash tools/bootstrap --engine vllm`")
    source, _, dtype, options = engine_families.FAMILIES[family]
    drafter = families.FAMILIES[family].drafter
    trained = source == engine_families.TRAINED
    root = tmp_path_factory.mktemp(family)
    engine_families.export(str(root), family)
    depths = [1] if drafter else []
    # a trained checkpoint's weights rounded to the engine's dtype (a random model's were before its import)
    project = launch("tests.bodies.engine:decode", 1, {"checkpoint": str(root / "checkpoint"),
                                                       "prompts": prompts(trained), "new_tokens": NEW_TOKENS,
                                                       "depths": depths, "rounded_to": dtype if trained else None},
                     timeout=600)[0]
    engine = {}
    with open(root / "engine.log", "w") as log:
        for depth in (0, *depths):
            spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": depth}} if depth else {}
            with vllm_engine.Engine(root / "hf", start_timeout=ENGINE_TIMEOUT, request_timeout=ENGINE_TIMEOUT,
                                    log=log, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                                    **options, **spec) as running:
                engine[depth] = [running.generate([prompt], NEW_TOKENS) for prompt in prompts(trained)]
    (root / "results.json").write_text(json.dumps({"project": project, "engine": engine}))
    return family, dtype, depths, CHAIN.get(drafter, "trained"), project, engine


def test_the_engine_s_greedy_tokens_and_drafts_equal_the_project_s(runs):
    family, dtype, depths, chain, project, engine = runs
    kept = [i for i, margin in enumerate(project["margin"]) if margin >= MARGIN[dtype]]
    assert len(kept) >= KEPT[dtype], project["margin"]
    for i in kept:
        plain = engine[0][i]["outputs"][0]
        assert plain == project["plain"][i], (family, i)
        for depth in depths:
            assert engine[depth][i]["outputs"][0] == plain, (family, depth, i)
            assert project[f"{chain} {depth}"][i]["tokens"] == plain, (family, depth, i)
    for depth in depths:
        counted = [(engine[depth][i]["spec_decode"]["drafts"],
                    engine[depth][i]["spec_decode"]["accepted per position"]) for i in kept]
        ours = [(project[f"{chain} {depth}"][i]["drafts"], project[f"{chain} {depth}"][i]["accepted per position"])
                for i in kept]
        assert sum(drafts for drafts, _ in counted) >= len(kept)  # the engine drafted
        assert counted == ours, family
