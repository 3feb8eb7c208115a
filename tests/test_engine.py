# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The heads in a real engine: vLLM's CPU build (`tools/bootstrap --engine vllm`), run as its own
process (megatron_mtp.serving.engines.vllm_engine), against the project's decoder.

One module fixture: a tiny Qwen2-shaped model with one repeated MTP layer at D = 2 (--add-qkv-bias,
heads of 32: the CPU attention's smallest head size), trained 100 iterations on the embedded corpus,
exported with --architecture mimo (vLLM's MiMo MTP drafts with it), and decoded by the project
(tests.bodies.engine) and by vLLM, one request per prompt so that each prompt's spec-decode counters
are its own. Greedy: vLLM's speculative tokens = its plain tokens = the project's; vLLM's verify steps
and accepted drafts per position = the project's with vLLM's draft chain (speculative.VllmDrafter),
prompt by prompt, at D = 1 and D = 2, where the project's decisions are clear of round-off (the
margin between the two largest logits of every argmax it took >= MARGIN; the others are counted, and
must be few). Without the engine the tests fail, naming the command that installs it (a missing tool
fails its tests instead of turning them off: docs/tests.md "Skips"); the README's test command installs it.
"""

import json
import subprocess
import sys
import time

import pytest

from megatron_mtp.serving.engines import vllm_engine
from tests.harness import corpora
from tests.harness.launcher import REPO_ROOT, launch
from tests.harness.trainer import train
from tests.harness.vllm_model import mimo_model

MODEL = mimo_model(layers=2, hidden=64, heads=2, query_groups=1, ffn=96, seq_length=64)
TRAIN = ("--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "100", "--lr", "3e-3",
         "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "50")
PROMPTS, PROMPT_LENGTH, NEW_TOKENS = 48, 24, 10
DEPTHS = (1, 2)
MARGIN = 1e-2  # logits; the engine's fp32 kernels differ from megatron-core's by ~1e-5 relative
DRAFT_TOL = 1e-4  # the drafter's logits (about 5 in size), engine against VllmDrafter
ENGINE_TIMEOUT = 300
UPDATE_DEPTH = 2
UPDATE_BUCKET_BYTES = 64 << 10  # small enough that every layer's tensors come in several batches


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The checkpoint (trained) and its MiMo export (hf)."""
    if not vllm_engine.available():
        pytest.fail(f"no vLLM at {vllm_engine.python()}: run `bash tools/bootstrap --engine vllm`")
    root = tmp_path_factory.mktemp("engine")
    train(1, *MODEL, *TRAIN, "--save", str(root / "trained"), "--save-interval", "100", timeout=600)
    subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", str(root / "trained"), str(root / "hf"),
                    "--architecture", "mimo"], cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    return root


def corpus_prompts() -> list:
    return corpora.corpus_prompts(PROMPTS, PROMPT_LENGTH, NEW_TOKENS)


@pytest.fixture(scope="module")
def runs(trained):
    root, prompts = trained, corpus_prompts()
    project = launch("tests.bodies.engine:decode", 1, {"checkpoint": str(root / "trained"), "prompts": prompts,
                                                       "new_tokens": NEW_TOKENS, "depths": list(DEPTHS)},
                     timeout=600)[0]
    engine = {}
    log = open(root / "engine.log", "w")
    for depth in (0, *DEPTHS):
        spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": depth}} if depth else {}
        with vllm_engine.Engine(root / "hf", start_timeout=ENGINE_TIMEOUT, request_timeout=ENGINE_TIMEOUT,
                                log=log, **spec) as running:
            engine[depth] = []
            for prompt in prompts:
                if depth == max(DEPTHS):  # the drafter's logits too, every draft step (engines/vllm_probe.py)
                    running.request({"op": "probe_drafts", "on": True})
                engine[depth].append(running.generate([prompt], NEW_TOKENS))
                if depth == max(DEPTHS):
                    calls = running.request({"op": "probe_drafts", "on": False})["logits"]
                    engine[depth][-1]["draft logits"] = [row for call in calls for row in call]
    log.close()
    (root / "results.json").write_text(json.dumps({"project": project, "engine": engine}))
    return project, engine


def clear(project) -> list:
    return [i for i, margin in enumerate(project["margin"]) if margin >= MARGIN]


def test_engine_tokens_equal_the_project_s_greedy_tokens(runs):
    project, engine = runs
    kept = clear(project)
    assert len(kept) >= PROMPTS * 3 // 4, project["margin"]
    for i in kept:
        plain = engine[0][i]["outputs"][0]
        assert plain == project["plain"][i], i
        for depth in DEPTHS:
            assert engine[depth][i]["outputs"][0] == plain, (depth, i)
            for chain in ("trained", "vllm"):
                assert project[f"{chain} {depth}"][i]["tokens"] == plain, (chain, depth, i)


@pytest.mark.parametrize("depth", DEPTHS)
def test_engine_counts_equal_the_vllm_chain_prompt_by_prompt(runs, depth):
    project, engine = runs
    kept = clear(project)
    counted = [(engine[depth][i]["spec_decode"]["drafts"], engine[depth][i]["spec_decode"]["accepted per position"])
               for i in kept]
    ours = [(project[f"vllm {depth}"][i]["drafts"], project[f"vllm {depth}"][i]["accepted per position"])
            for i in kept]
    assert sum(drafts for drafts, _ in counted) > PROMPTS  # the engine drafted
    assert counted == ours


def test_the_engine_s_drafts_are_the_vllm_chain_s_draft_by_draft(runs):
    """The drafter's logits in the engine at D = 2, every draft step of every compared prompt, equal
    VllmDrafter's within DRAFT_TOL (fp32 round-off; measured up to 2e-6 on logits of about 5), and the
    trained chain's first drafting (the same state: the prompt and its first token) differs from the
    engine's by more than 10 x DRAFT_TOL on most prompts: the test tells the two chains apart where the
    counts do not (the MiMo MTP's input is the main model's state before its final norm in vLLM, after
    it as trained). The engine also drafts once after the last verify step (its drafts unused)."""
    import torch

    project, engine = runs
    depth, kept = max(DEPTHS), clear(project)
    apart = 0
    for i in kept:
        ours = torch.tensor(project[f"vllm {depth}"][i]["draft logits"])
        served = torch.tensor(engine[depth][i]["draft logits"])
        assert len(served) - len(ours) in (0, depth), (i, len(served), len(ours))
        assert float((served[: len(ours)] - ours).abs().max()) <= DRAFT_TOL, i
        trained = torch.tensor(project[f"trained {depth}"][i]["draft logits"])[:depth]
        apart += float((served[:depth] - trained).abs().max()) > 10 * DRAFT_TOL
    assert apart >= len(kept) * 3 // 4, (apart, len(kept))


@pytest.fixture(scope="module")
def updated(trained):
    """A second policy (the same model trained from another seed, with two distinct depths where the first
    had one repeated layer: the export's names and shapes are the same, every weight differs) as a live
    model at PP = 2 on two gloo ranks, streamed into an engine started on the first policy's export
    (target alone, then target and drafter; tests.bodies.engine.update), and the project's decoder on its
    checkpoint. vLLM runs the first depth at every draft step (VllmDrafter), so the distinct depths are
    also the engine tier's check of that."""
    root, prompts = trained, corpus_prompts()
    distinct = mimo_model(layers=2, hidden=64, heads=2, query_groups=1, ffn=96, seq_length=64, repeated=False)
    train(1, *distinct, *TRAIN, "--seed", "7", "--save", str(root / "policy"), "--save-interval", "100", timeout=600)
    project = launch("tests.bodies.engine:decode", 1, {"checkpoint": str(root / "policy"), "prompts": prompts,
                                                       "new_tokens": NEW_TOKENS, "depths": [UPDATE_DEPTH]},
                     timeout=600)[0]
    engine = launch("tests.bodies.engine:update", 2,
                    {"old_export": str(root / "hf"), "checkpoint": str(root / "policy"), "pp": 2, "prompts": prompts,
                     "new_tokens": NEW_TOKENS, "depth": UPDATE_DEPTH, "bucket_bytes": UPDATE_BUCKET_BYTES,
                     "engine_timeout": ENGINE_TIMEOUT}, timeout=900)[0]
    return project, engine


def test_an_update_in_place_gives_the_engine_the_new_policy_s_drafts(updated):
    """After the weight stream's update of target and drafter, the engine's greedy tokens and its
    verify steps and accepted drafts per position are the project's on the new policy (vLLM's draft
    chain), prompt by prompt. The control: after the target's update alone, the tokens are the new
    policy's but the acceptance is not (the drafter still drafts with the old heads: verl #6947), so
    the comparison sees a drafter that did not take the new weights."""
    project, engine = updated
    kept = clear(project)
    assert len(kept) >= PROMPTS * 3 // 4, project["margin"]
    assert 0 < engine["target only bytes"] < engine["target and drafter bytes"]

    def counts(results):
        return [(results[i]["spec_decode"]["drafts"], results[i]["spec_decode"]["accepted per position"])
                for i in kept]

    ours = [(project[f"vllm {UPDATE_DEPTH}"][i]["drafts"],
             project[f"vllm {UPDATE_DEPTH}"][i]["accepted per position"]) for i in kept]
    for phase in ("target only", "target and drafter"):
        assert [engine[phase][i]["outputs"][0] for i in kept] == [project["plain"][i] for i in kept], phase
    assert [engine["before"][i]["outputs"][0] for i in kept] != [project["plain"][i] for i in kept]
    assert counts(engine["target only"]) != ours
    assert counts(engine["target and drafter"]) == ours


def test_an_engine_that_does_not_answer_is_closed_with_its_children(tmp_path, monkeypatch):
    """The harness's deadline: an engine process that never answers (here a stand-in interpreter that
    starts a child, as vLLM starts workers, and sleeps) raises after start_timeout, and neither it nor
    its child is left running."""
    pids = tmp_path / "pids"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\nsleep 300 &\necho $$ $! > {pids}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MEGATRON_MTP_VLLM_PYTHON", str(fake))
    with pytest.raises(TimeoutError, match="no reply to start within 2 s"):
        vllm_engine.Engine(tmp_path / "model", start_timeout=2)
    started = list(map(int, pids.read_text().split()))
    assert len(started) == 2, started
    # the orphaned child, killed, stays a zombie until init reaps it (slower under load): not running
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if _running(pid)], started


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (killed, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
