# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The draft objectives compared where they are served: vLLM's acceptance at temperature 1, both draft modes.

    MEGATRON_MTP_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python -m benchmarks.draft_objectives_served \\
        --work DIR [--policy CKPT] [--head-iters 400] [--objectives ce kl tv e2e_tv] [--figure PNG]

One fixed policy: benchmarks.vllm_speculative_bench's model (Qwen2-shaped, 8 layers, hidden 256, one
repeated MTP layer at D = 2), trained with ce heads on the embedded corpus (--policy, or trained here).
From that checkpoint, each objective retrains the heads alone for --head-iters iterations
(`--load POLICY --finetune --freeze-backbone --mtp-detach-heads --mtp-loss-type OBJ`: the same start,
the same data, the same seed; the backbone never moves), and the trainer's validation reports its
teacher-forced sampled and greedy-draft acceptances every --eval-interval iterations (whether it has
converged). Each set of heads is exported as MiMo and served by vLLM's CPU build (with the project's
engine series) at temperature 1, once with greedy drafts (vLLM's default) and once with probabilistic
ones: --prompts corpus prompts, --seeds responses each, --new-tokens tokens, a seed per response.

Printed, per objective and draft mode: vLLM's acceptance per position and mean acceptance length
(1 + accepted / verify steps) with its standard error (jackknife over responses); beside them the
teacher-forced alpha and beta on corpus text at temperature 1 (the project's decoder, the trained
chain: speculative.teacher_forced) and the expected accepted lengths they give; and the share of the
sampled tokens that end an 8-gram already in their text (the policy's text is not degenerate when it
is small). A JSON of everything goes to --work, and --figure draws the mean acceptance lengths.
"""

import argparse
import json
import os
import time
import warnings
from pathlib import Path

from benchmarks.vllm_speculative_bench import MODEL, TRAIN, export, repeated_share

OBJECTIVES = ("ce", "kl", "tv", "e2e_tv")
MODES = ("greedy", "probabilistic")  # vLLM's draft_sample_method: its default first


def train_policy(directory: Path, iterations: int) -> None:
    from tests.harness.trainer import train

    run = train(2, *MODEL, *TRAIN, "--train-iters", str(iterations), "--lr-warmup-iters", str(iterations // 10),
                "--save", str(directory), "--save-interval", str(iterations), timeout=7200)
    if run.returncode:
        raise SystemExit(f"the policy's training failed:\n{run.tail()}")


def train_heads(policy: Path, objective: str, directory: Path, args) -> dict:
    """The heads retrained from the policy's checkpoint with one objective; the validations' metrics."""
    from tests.harness.trainer import train

    run = train(2, *MODEL, "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", str(args.head_lr),
                "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--clip-grad", "1.0",
                "--log-interval", "50", "--eval-interval", str(args.eval_interval), "--eval-iters", "8",
                "--train-iters", str(args.head_iters), "--load", str(policy), "--finetune", "--freeze-backbone",
                "--mtp-detach-heads", "--mtp-loss-scaling-factor", "1.0", "--mtp-loss-type", objective,
                "--save", str(directory), "--save-interval", str(args.head_iters), timeout=7200)
    if run.returncode:
        raise SystemExit(f"the {objective} heads' training failed:\n{run.tail()}")
    return {str(iteration): values for iteration, values in sorted(run.validations.items())}


def serve(export_dir: Path, prompts: list, args, log) -> dict:
    """vLLM at temperature 1 in each draft mode: per mode the responses and each response's counts."""
    from megatron_mtp.serving.engines import vllm_engine

    requests = [p for p in prompts for _ in range(args.seeds)]
    out = {}
    for mode in MODES:
        spec = {"method": "mtp", "num_speculative_tokens": args.depths, "draft_sample_method": mode}
        with vllm_engine.Engine(export_dir, log=log, speculative_config=spec) as engine:
            reply = engine.generate(requests, args.new_tokens, temperature=1.0, seeds=list(range(len(requests))),
                                    steps=True)
        per_response = []  # (verify steps, accepted per position) of each response, from its recorded steps
        for steps in reply["steps"]:
            accepted = [len(tokens) - 1 for verified, tokens in steps if verified]
            per_response.append((len(accepted), [sum(a > k for a in accepted) for k in range(args.depths)]))
        held = (sum(n for n, _ in per_response), [sum(r[k] for _, r in per_response) for k in range(args.depths)])
        if held != (reply["spec_decode"]["drafts"], reply["spec_decode"]["accepted per position"]):
            raise SystemExit(f"the recorded steps hold {held}, the engine counted {reply['spec_decode']}")
        out[mode] = {"outputs": reply["outputs"], "per response": per_response, "counted": reply["spec_decode"]}
    return out


def mean_length(per_response: list) -> tuple[float, float]:
    """vLLM's mean acceptance length, 1 + accepted / verify steps, and its jackknife standard error over
    the responses (the steps of one response are not independent of each other)."""
    steps = sum(n for n, _ in per_response)
    accepted = sum(sum(r) for _, r in per_response)
    value = 1 + accepted / steps
    leave_out = [1 + (accepted - sum(r)) / (steps - n) for n, r in per_response]
    mean = sum(leave_out) / len(leave_out)
    count = len(per_response)
    return value, ((count - 1) / count * sum((v - mean) ** 2 for v in leave_out)) ** 0.5


def teacher_forced(checkpoint: Path, pairs: list, depths: int) -> dict:
    """The project's decoder on corpus text at temperature 1: alpha and beta per depth, and the expected
    accepted lengths (incl. bonus) of chained probabilistic and greedy drafts."""
    import torch

    from megatron_mtp.serving import files, speculative
    from megatron_mtp.serving import model as serving_model

    torch.set_grad_enabled(False)
    run_args, directory = files.read_arguments(str(checkpoint))
    serving_model.setup()
    model = serving_model.build(run_args)
    serving_model.load(model, str(directory))
    runner = serving_model.Runner(model, int(run_args.vocab_size or run_args.padded_vocab_size))
    stats = speculative.Stats(depths=depths)
    for _, text in pairs:
        speculative.teacher_forced(runner, [int(t) for t in text], stats, 1.0)
    summary = stats.summary()
    return {"alpha": summary["teacher-forced sampled acceptance per depth"],
            "beta": summary["teacher-forced greedy-draft acceptance per depth"],
            "expected length (probabilistic)": summary["teacher-forced expected accepted length (sampling)"],
            "expected length (greedy)": summary["teacher-forced expected accepted length (greedy drafts)"]}


def figure(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = list(results)
    fig, ax = plt.subplots(figsize=(7, 4.4))
    width = 0.38
    for i, mode in enumerate(MODES):
        xs = [j + (i - 0.5) * width for j in range(len(objectives))]
        values = [results[o]["served"][mode]["mean acceptance length"] for o in objectives]
        errors = [results[o]["served"][mode]["standard error"] for o in objectives]
        ax.bar(xs, values, width, yerr=errors, capsize=3, label=f"vLLM, {mode} drafts")
        key = "expected length (greedy)" if mode == "greedy" else "expected length (probabilistic)"
        ax.scatter(xs, [results[o]["teacher-forced"][key] for o in objectives], color="black", marker="_", s=300,
                   zorder=3, label="teacher-forced on corpus text" if i else None)
    ax.set_xticks(range(len(objectives)), objectives)
    ax.set_ylim(bottom=1.0)  # a verify step emits at least its bonus token
    ax.set_ylabel("mean acceptance length (incl. bonus)")
    ax.set_title("Heads retrained on one policy, served by vLLM at temperature 1 (D = 2)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="directory for the checkpoints, exports, engine log and JSON")
    parser.add_argument("--policy", help="the policy's checkpoint (default: train MODEL for --policy-iters)")
    parser.add_argument("--policy-iters", type=int, default=600)
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--head-iters", type=int, default=400)
    parser.add_argument("--head-lr", type=float, default=1e-3)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--depths", type=int, default=2, help="drafts a verify step (the model's MTP depths)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2, help="responses per prompt, each with a seed of its own")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--figure", help="draw the mean acceptance lengths to this PNG")
    args = parser.parse_args()
    if min(args.head_iters, args.eval_interval, args.prompts, args.seeds, args.new_tokens, args.policy_iters) < 1:
        parser.error("counts must be positive")
    if not 1 <= args.depths <= 2:
        parser.error("--depths: 1 or 2 (the model has 2 MTP depths)")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from megatron_mtp.data.embedded import corpus_prefix, default_cache_dir
    from megatron_mtp.serving import prompts as serving_prompts
    from megatron_mtp.serving.engines import vllm_engine

    if not vllm_engine.available():
        raise SystemExit(f"no vLLM at {vllm_engine.python()}: run `bash tools/bootstrap --engine vllm`")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    policy = Path(args.policy) if args.policy else work / "policy"
    if not args.policy and not (policy / "latest_checkpointed_iteration.txt").is_file():
        train_policy(policy, args.policy_iters)
    pairs = serving_prompts.dataset_prompts(str(corpus_prefix(default_cache_dir())), args.prompts,
                                            args.prompt_length, args.new_tokens)
    prompts = [[int(t) for t in prompt] for prompt, _ in pairs]
    results = {}
    with open(work / "engine.log", "a") as log:
        for objective in args.objectives:
            started = time.perf_counter()
            heads = work / f"heads-{objective}"
            validations = train_heads(policy, objective, heads, args)
            export(heads, work / f"hf-{objective}")
            served = serve(work / f"hf-{objective}", prompts, args, log)
            result = {"validations": validations, "teacher-forced": teacher_forced(heads, pairs, args.depths),
                      "served": {}}
            for mode, run in served.items():
                length, error = mean_length(run["per response"])
                counted = run["counted"]
                result["served"][mode] = {
                    "mean acceptance length": length, "standard error": error, "verify steps": counted["drafts"],
                    "acceptance per position": [a / counted["drafts"] for a in counted["accepted per position"]],
                    "repeated 8-grams": sum(repeated_share(p, o) for p, o in zip(
                        [p for p in prompts for _ in range(args.seeds)], run["outputs"], strict=True))
                    / len(run["outputs"])}
            results[objective] = result
            (work / "results.json").write_text(json.dumps(results, indent=1))
            print(f"{objective}: trained, exported and served in {time.perf_counter() - started:.0f} s", flush=True)
    print(f"policy {policy}; heads retrained {args.head_iters} iterations each from it; vLLM at temperature 1, "
          f"D = {args.depths}, {args.prompts} prompts x {args.seeds} seeds x {args.new_tokens} tokens")
    print("| objective | draft mode | mean acceptance length (SE) | acceptance per position | teacher-forced "
          "alpha / beta per depth | teacher-forced expected length | repeated 8-grams |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for objective, result in results.items():
        tf = result["teacher-forced"]
        for mode, served in result["served"].items():
            rates = tf["beta"] if mode == "greedy" else tf["alpha"]
            expected = tf["expected length (greedy)" if mode == "greedy" else "expected length (probabilistic)"]
            print(f"| {objective} | {mode} | {served['mean acceptance length']:.3f} ({served['standard error']:.3f}) | "
                  + " / ".join(f"{a:.3f}" for a in served["acceptance per position"])
                  + f" | {' / '.join(f'{a:.3f}' for a in rates)} ({'beta' if mode == 'greedy' else 'alpha'}) | "
                  f"{expected:.3f} | {served['repeated 8-grams']:.3f} |", flush=True)
    if args.figure:
        figure(results, args.figure)


if __name__ == "__main__":
    main()
