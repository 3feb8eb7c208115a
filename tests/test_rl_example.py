# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""examples/rl/grpo.py, shortened: GRPO with speculative rollouts on 2 CPU ranks (issue 29, C).

Four runs from one seed, as examples/rl/compare.sh runs them (and a fifth at token level): MTP heads trained online
(cross-entropy; and e2e_tv on positive-advantage responses only), heads frozen after the warm start, no heads. The
policy's trajectory is the same in all four (every step's reward, and the backbone's weights by sha256), so the heads
cannot have touched it; the
online heads change and the frozen ones do not; the drafts were accepted (the rollouts were
speculative) and every step logged reward and acceptance in the console format that
tools/plot_runs.py reads; before every step's rollouts the rollout model takes the policy's weights
from the weight stream (serving.stream) and holds them bit for bit. The task's reward is checked by
hand.

The tiny Qwen3.5-MoE policy (--policy qwen3_5: Gated DeltaNet and gated attention layers, MoE with a
shared expert and aux_loss, one repeated MTP layer) on packed rows at context_parallel_size 2 (matrix
tier): heads online, frozen and none, the same trajectory check; its engine decodes over the Gated
DeltaNet layers' recurrent state and takes Qwen3.5-MoE's Hugging Face names from the stream.

--engine vllm: plain rollouts (the coupled comparison) push the policy into vLLM every step, and the
engine's greedy acceptance equals the decoder's; speculative rollouts (the default) run in one engine
at temperature 1, print the engine's own acceptance per depth for each step in both draft modes, and
repeat exactly.
"""

import json
import re

import pytest

from megatron_mtp.runs import read
from tests.harness.trainer import train

pytestmark = pytest.mark.slow

STEPS = 3
SHORT = ("--steps", str(STEPS), "--sft-steps", "20", "--prompts-per-step", "4", "--group-size", "4",
         "--micro-batch-size", "8", "--length", "3")


def test_the_reversal_task_rewards_exactly():
    from examples.rl.task import BOS, EOS, EQUALS, Reversal

    task = Reversal(length=3, alphabet=4)
    prompts = task.prompts(5, seed=1, step=2)
    assert prompts == task.prompts(5, seed=1, step=2) != task.prompts(5, seed=1, step=3)
    assert all(p[0] == BOS and p[-1] == EQUALS and len(p) == 5 for p in prompts)
    assert task.answer([BOS, 3, 4, 6, EQUALS]) == [6, 4, 3, EOS]
    assert task.reward([BOS, 3, 4, 6, EQUALS], [6, 4, 3, EOS]) == 1.0
    assert task.reward([BOS, 3, 4, 6, EQUALS], [6, 3, 3, 0]) == 0.5
    assert task.reward([BOS, 3, 4, 6, EQUALS], [6, 4, EOS]) == 0.5  # ended early: fewer tokens in place
    for wrong in ([], [6, 4, 3, EOS, EOS]):
        with pytest.raises(ValueError):
            task.reward([BOS, 3, 4, 6, EQUALS], wrong)


def assert_one_trajectory(summaries: dict, runs: dict, drift: float = 0.0) -> None:
    """The runs (online, frozen, none, ...) took the stream's weights before every step's rollouts (the
    engine held them bit for bit, its parameters within `drift` of the policy's) and share the policy's
    trajectory: every step's reward, policy-gradient loss and grad norm, and the backbone's weights at
    the end; the online heads trained, the frozen ones did not."""
    online, frozen, none = summaries["online"], summaries["frozen"], summaries["none"]
    for name, summary in summaries.items():
        assert summary["rollout model synced"] == [True] * STEPS, (name, summary["rollout model synced"])
        differences = summary["rollout model largest difference from the policy"]
        assert len(differences) == STEPS and max(differences) <= drift, (name, differences)
    assert len(online["rewards"]) == STEPS and 0 < sum(online["rewards"])
    for heads, other in summaries.items():
        assert other["rewards"] == online["rewards"], heads
        assert other["backbone sha256"] == online["backbone sha256"], heads
        for series in ("policy-gradient loss", "grad norm"):  # as logged (6 significant digits)
            assert runs[heads].series[series] == runs["online"].series[series], (heads, series)
    assert online["heads sha256"] != online["heads sha256 after warm start"]
    assert frozen["heads sha256"] == frozen["heads sha256 after warm start"]
    assert none["heads sha256"] is None


def test_rl_with_speculative_rollouts_leaves_the_policy_s_trajectory_to_the_policy(tmp_path):
    summaries, runs = {}, {}
    variants = {"online": ("--heads", "online"), "frozen": ("--heads", "frozen"), "none": ("--heads", "none"),
                # a draft objective of spec section 12, on positive-advantage responses only
                "e2e_tv": ("--heads", "online", "--mtp-loss-type", "e2e_tv", "--mtp-positive-advantage")}
    for name, options in variants.items():
        out = tmp_path / name
        train(2, *options, "--out", str(out), *SHORT, script="examples/rl/grpo.py")
        summaries[name] = json.loads((out / "summary.json").read_text())
        runs[name] = read(out / "console.log")
    assert_one_trajectory(summaries, runs)
    online, none, e2e_tv = summaries["online"], summaries["none"], summaries["e2e_tv"]
    assert e2e_tv["mtp loss type"] == "e2e_tv" and e2e_tv["heads sha256"] not in (
        online["heads sha256"], e2e_tv["heads sha256 after warm start"])  # other heads, trained

    series = runs["online"].series
    assert sorted(series["reward"]) == list(range(1, STEPS + 1))
    assert [series["reward"][step] for step in range(1, STEPS + 1)] == pytest.approx(online["rewards"], abs=1e-5)
    assert sum(series["mtp_1 rollout acceptance"].values()) > 0  # drafts were accepted
    assert {"mtp_2 rollout acceptance", "rollout mean acceptance length (incl. bonus)", "mtp_2 acceptance",
            "mtp_2 sampled acceptance", "mtp_2 engine acceptance", "engine mean acceptance length (incl. bonus)",
            "mtp_2 greedy-draft acceptance", "mtp_2 engine acceptance (greedy drafts)",
            "engine mean acceptance length (incl. bonus) (greedy drafts)", "mtp_2 loss", "mtp grad norm"} <= set(series)
    assert sum(series["mtp_1 engine acceptance"].values()) > 0  # rejection sampling accepted drafts too
    assert sum(series["mtp_1 engine acceptance (greedy drafts)"].values()) > 0  # and greedy drafts
    assert "mtp_1 rollout acceptance" not in runs["none"].series
    assert runs["none"].tokens[STEPS] == STEPS * 4 * 4 * 8  # consumed responses x (prompt + answer - 1)

    # The policy gradient at token level (GRPO's default here is sequence level): the first
    # rollouts are the same (same policy), the updates are not.
    train(2, "--heads", "none", "--main-loss-level", "token", "--out", str(tmp_path / "token"), *SHORT,
          script="examples/rl/grpo.py")
    token = json.loads((tmp_path / "token" / "summary.json").read_text())
    assert token["rewards"][0] == none["rewards"][0] and token["backbone sha256"] != none["backbone sha256"]


@pytest.mark.matrix
def test_the_qwen3_5_policy_on_packed_rows_at_cp_2_keeps_one_trajectory(tmp_path):
    summaries, runs = {}, {}
    for heads in ("online", "frozen", "none"):
        out = tmp_path / heads
        train(2, "--policy", "qwen3_5", "--context-parallel-size", "2", "--heads", heads, "--out", str(out), *SHORT,
              script="examples/rl/grpo.py", timeout=600)
        summaries[heads] = json.loads((out / "summary.json").read_text())
        runs[heads] = read(out / "console.log")
    arguments = summaries["online"]["arguments"]
    assert (arguments["rows"], arguments["context_parallel_size"], arguments["num_layers"]) == ("packed", 2, 4)
    # the Gated DeltaNet output norm streams as 1 + w: w' + 1 - 1 within half an ulp of 1 (docs/serving.md)
    assert_one_trajectory(summaries, runs, drift=2.0 ** -24)
    series = runs["online"].series
    assert sum(series["mtp_1 rollout acceptance"].values()) > 0  # the heads drafted over the recurrent state
    assert sum(series["mtp_2 rollout acceptance"].values()) > 0
    assert all(value > 0 for value in series["mtp_1 load balancing loss"].values())  # the depth's aux_loss


def vllm_runs(tmp_path, heads: tuple) -> tuple[dict, dict]:
    summaries, runs = {}, {}
    for name in heads:
        out = tmp_path / name
        train(2, "--policy", "mimo", "--engine", "vllm", "--rollouts", "plain", "--heads", name, "--weight-bucket-mb",
              "0.01", "--out", str(out), *SHORT, script="examples/rl/grpo.py", timeout=600)
        summaries[name] = json.loads((out / "summary.json").read_text())
        runs[name] = read(out / "console.log")
    return summaries, runs


def test_rl_with_vllm_rollouts_pushes_the_policy_into_the_engine_every_step(tmp_path):
    """--engine vllm --rollouts plain (issue 49): vLLM's CPU build samples the rollouts and drafts with the heads, its
    weights pushed in place every step in batches of 10 KiB; the engine's greedy acceptance per depth
    equals the project's decoder's on the same prompts with vLLM's draft chain, every step, so the
    engine drafted with the heads as they are after each step's update."""
    summaries, runs = vllm_runs(tmp_path, ("online",))
    online, series = summaries["online"], runs["online"].series
    assert len(online["bytes pushed into vllm"]) == STEPS and min(online["bytes pushed into vllm"]) > 0
    assert online["heads sha256"] != online["heads sha256 after warm start"]  # the heads moved between pushes
    for k in (1, 2):
        assert series[f"mtp_{k} vllm greedy acceptance"] == series[f"mtp_{k} decoder greedy acceptance"], k
    assert sum(series["mtp_1 vllm greedy acceptance"].values()) > 0  # the engine's drafts were accepted
    assert "mtp_1 rollout acceptance" not in series  # vLLM's rollouts are plain sampling
    assert "mtp_1 vllm acceptance" not in series
    assert {"mtp_1 engine acceptance", "mtp_1 engine acceptance (greedy drafts)", "rollout seconds"} <= set(series)


@pytest.mark.matrix
def test_rl_with_vllm_rollouts_keeps_one_trajectory(tmp_path):
    """--engine vllm --rollouts plain with heads online, frozen and none: the same rewards, losses and backbone (the
    rollouts are vLLM's plain sampling with a seed per response, on the pushed policy)."""
    summaries, runs = vllm_runs(tmp_path, ("online", "frozen", "none"))
    assert_one_trajectory(summaries, runs)


def engine_counts(responses_steps: list, depths: int) -> list:
    """[verify steps, accepted per position...] as vLLM counts them, from the sampling steps the engine
    recorded for each response ([drafts verified, [tokens]]: a step that verified drafts emitted the
    drafts it accepted and the token after them)."""
    counts = [0] * (1 + depths)
    for steps in responses_steps:
        for verified, tokens in steps:
            if verified:
                counts[0] += 1
                for k in range(1, len(tokens)):
                    counts[k] += 1
    return counts


def masked(console: str) -> str:
    """A console log without what a rerun may change: the time of day and the rollout seconds."""
    console = re.sub(r"^ \[[^]]*\]", " [time]", console, flags=re.MULTILINE)
    return re.sub(r"rollout seconds( per rank)?: [^|]*\|", "rollout seconds: - |", console)


@pytest.mark.parametrize("method", ("greedy", "probabilistic"))
def test_rl_with_vllm_speculative_rollouts_reports_the_engine_s_own_acceptance(tmp_path, method):
    """--engine vllm's default (issue 57 D): one engine samples the rollouts at temperature 1, a seed per
    response, the heads drafting with vLLM's draft_sample_method `method` (greedy: its default, no flag);
    every step's acceptance per depth is that engine's counters for the step's rollouts, which equal
    the counts its recorded sampling steps hold, and the step trains on those responses. With
    probabilistic drafts, which follow the request's seed (the engine's patch 0002), a second run
    repeats the first token for token, its engine's own generator seeded otherwise."""
    from examples.rl.task import Reversal

    flags = () if method == "greedy" else ("--draft-sample-method", method)
    outs = [tmp_path / str(run) for run in range(1 if method == "greedy" else 2)]
    for out in outs:
        train(2, "--policy", "mimo", "--engine", "vllm", "--heads", "online", *flags, "--out", str(out), *SHORT,
              script="examples/rl/grpo.py", timeout=600)
    out = outs[0]
    summary = json.loads((out / "summary.json").read_text())
    series = read(out / "console.log").series
    assert summary["arguments"]["rollouts"] == "speculative"
    # as the live engine's own config holds it, and one engine for the run
    assert summary["vllm rollout engine"]["speculative config"] == {"method": "mtp", "num_speculative_tokens": 2,
                                                                   "draft_sample_method": method}
    assert (out / "engine.log").read_text().count("Initializing a V1 LLM engine") == 1
    records = [json.loads(line) for line in (out / "engine_tokens.jsonl").read_text().splitlines()]
    assert [record["iteration"] for record in records] == list(range(1, STEPS + 1))
    task, group = Reversal(length=3), 4
    for step, record in enumerate(records, 1):
        counted = record["spec_decode"]
        counts = engine_counts(record["steps"], 2)
        assert counts == [counted["drafts"], *counted["accepted per position"]], step  # the engine's counters
        assert counts[1] > 0, step  # drafts were accepted
        for k in (1, 2):
            assert series[f"mtp_{k} vllm acceptance"][step] == pytest.approx(counts[k] / counts[0], rel=1e-5), step
        assert series["vllm mean acceptance length (incl. bonus)"][step] == pytest.approx(
            1 + sum(counts[1:]) / counts[0], rel=1e-5)
        rewards = [task.reward(p, r) for p, r in zip(record["prompts"], record["outputs"], strict=True)]
        assert summary["rewards"][step - 1] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12), step
    # temperature 1: a prompt's responses, each with its own seed, differ (at temperature 0 they are one)
    groups = [record["outputs"][i:i + group] for record in records for i in range(0, len(record["outputs"]), group)]
    assert sum(len({tuple(response) for response in responses}) > 1 for responses in groups) > len(groups) // 2
    assert "rollout seconds" in series and "mtp_1 rollout acceptance" not in series
    if method == "probabilistic":
        repeat = outs[1]
        assert (repeat / "engine_tokens.jsonl").read_text() == (out / "engine_tokens.jsonl").read_text()
        again = json.loads((repeat / "summary.json").read_text())
        # the engine's own generator seeded otherwise: the responses' seeds alone make the run repeat
        assert again["vllm rollout engine"]["seed"] != summary["vllm rollout engine"]["seed"]
        for field in ("rewards", "backbone sha256", "heads sha256"):
            assert again[field] == summary[field], field
        assert masked((repeat / "console.log").read_text()) == masked((out / "console.log").read_text())
