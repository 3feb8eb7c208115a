# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""vLLM's speculative decoding with the project's MTP heads against vLLM's plain decoding, side by side.

    MEGATRON_MTP_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python -m benchmarks.vllm_speculative_bench \\
        [--checkpoint CKPT] [--work DIR] [--train-iters 600] [--prompts 16] [--new-tokens 96] [--rounds 4]
        [--temperature 1 --draft-sample-methods greedy probabilistic]

Without --checkpoint it trains a Qwen2-shaped model deep enough that a draft step (one MTP layer)
costs less than a target step (MODEL: 8 layers, hidden 256, heads of 64, one repeated MTP layer at
D = 2, as vLLM serves it) on the embedded byte corpus (`pretrain_gpt_mtp.py`, torchrun, one thread
per rank), then exports it with `--architecture mimo`. vLLM's CPU build (engines.vllm_engine, its
defaults: fp32, eager; one torch thread, Intel OpenMP preloaded as vLLM's CPU guide says unless
--no-iomp) decodes the same prompts (--prompt-length bytes from byte --prompt-offset of documents of
the corpus, past the topics' titles) greedily, plain and with D = 1 and 2 MTP drafts: one engine at
a time, each started afresh in every round (the rounds alternate them), a warm-up request
first, then every prompt at every --batch-sizes (the prompts in consecutive batches). Each side's
outputs are compared with plain's at the same batch size; a difference is printed (where the greedy
choice is a near tie, fp32 round-off in a different batch shape can flip it), never hidden.
With --temperature T > 0 every side samples at T, each prompt's response with its seed, and each
depth drafts in every --draft-sample-methods mode (vLLM's draft_sample_method: greedy drafts, its
default, accepted with p(d); probabilistic, accepted with min(1, p/q)); sampled outputs are lossless
in distribution only (tests/test_engine.py), so they are not compared.

Printed: per batch size and side, generated tokens per second (wall, medians over rounds), the
speed-up over plain in wall time and in the engine process's CPU time (its own work, whatever else
the shared host runs), each the median of the rounds' ratios; vLLM's acceptance per draft position
(accepted / drafts) and mean acceptance length (1 + accepted / drafts); at batch size 1, the
engine's CPU time per step (plain: per token, one target step; speculative: per verify step) and
what it implies for one draft step (the verify step at D = 2 minus that at D = 1); and how much of
the plain output repeats itself (greedy decoding of a small model falls into loops, which drafts
predict easily), with one prompt's continuation.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from tests.harness.vllm_model import mimo_model

# heads of 64, one repeated MTP layer at D = 2
MODEL = mimo_model(layers=8, hidden=256, heads=4, query_groups=2, ffn=704, seq_length=128)
TRAIN = ("--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "2e-3", "--min-lr", "2e-4",
         "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01",
         "--eval-iters", "0", "--log-interval", "50")
DEPTHS = (1, 2)


def train(directory: Path, iterations: int, ranks: int) -> None:
    from tests.harness.trainer import train as run

    started = time.perf_counter()
    result = run(ranks, *MODEL, *TRAIN, "--train-iters", str(iterations),
                 "--lr-warmup-iters", str(iterations // 10), "--save", str(directory),
                 "--save-interval", str(iterations), timeout=3600)
    last = result.iterations[max(result.iterations)]
    # the losses, and the heads' teacher-forced acceptance of greedy drafts on the training batch
    shown = ", ".join(f"{name} {value:.3f}" for name, value in last.items()
                      if name.endswith(" loss") or "greedy" in name)
    print(f"trained {iterations} iterations on {ranks} ranks in {time.perf_counter() - started:.0f} s; "
          f"iteration {max(result.iterations)}: {shown}", flush=True)


def export(checkpoint: Path, directory: Path) -> None:
    done = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", str(checkpoint), str(directory),
                           "--architecture", "mimo"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        raise SystemExit(f"export of {checkpoint} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")


def cpu_seconds(process) -> float:
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def decode(engine, prompts: list, new_tokens: int, batch: int, temperature: float = 0.0) -> dict:
    """Every prompt, `batch` at a time: the outputs in prompt order, the wall seconds, the engine
    process's CPU seconds (its own work, whatever else the machine runs) and the summed counters."""
    import psutil

    process = psutil.Process(engine.process.pid)
    outputs, seconds, cpu, counts = [], 0.0, 0.0, {}
    for first in range(0, len(prompts), batch):
        started, used = time.perf_counter(), cpu_seconds(process)
        reply = engine.generate(prompts[first:first + batch], new_tokens, temperature=temperature,
                                seeds=list(range(first, first + batch)) if temperature else None)
        seconds += time.perf_counter() - started
        cpu += cpu_seconds(process) - used
        outputs += reply["outputs"]
        for name, value in reply["spec_decode"].items():
            if isinstance(value, list):
                old = counts.get(name, [0] * len(value))
                counts[name] = [a + b for a, b in zip(value, old, strict=True)]
            else:
                counts[name] = counts.get(name, 0) + value
    return {"outputs": outputs, "seconds": seconds, "cpu": cpu, "spec_decode": counts}


def first_difference(a: list, b: list) -> int | None:
    if len(a) != len(b):
        return min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def repeated_share(prompt: list, output: list, n: int = 8) -> float:
    """The share of generated tokens that end an n-gram already in the text before them: tokens a
    decoding loop repeats (greedy decoding of a small model falls into loops, which drafts predict)."""
    text, repeated = prompt + output, 0
    for end in range(len(prompt) + 1, len(text) + 1):
        window = text[end - n:end]
        repeated += any(text[start:start + n] == window for start in range(0, end - n))
    return repeated / len(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a trained checkpoint to export (default: train MODEL)")
    parser.add_argument("--work", help="directory for the checkpoint, export and engine log (default: temporary)")
    parser.add_argument("--train-iters", type=int, default=600)
    parser.add_argument("--train-ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--prompt-offset", type=int, default=128,
                        help="where in its document a prompt starts (past the topic's title and its underline)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling, a seed a prompt")
    parser.add_argument("--draft-sample-methods", nargs="+", choices=("greedy", "probabilistic"), default=["greedy"],
                        help="vLLM's draft modes to run each depth in (probabilistic needs --temperature > 0)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads (OMP_NUM_THREADS)")
    parser.add_argument("--no-iomp", action="store_true",
                        help="start the engine without Intel OpenMP preloaded (vLLM's CPU guide preloads it)")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or max(args.batch_sizes) > 8:
        parser.error("--batch-sizes: 1 to 8 (the engine's max_num_seqs)")
    if min(args.prompts, args.prompt_length, args.new_tokens, args.rounds, args.train_iters, args.train_ranks) < 1 \
            or args.prompt_offset < 0:
        parser.error("counts must be positive and --prompt-offset not negative")
    if args.temperature < 0 or (args.temperature == 0 and args.draft_sample_methods != ["greedy"]):
        parser.error("--temperature must be >= 0; probabilistic drafts need --temperature > 0 (greedy decoding "
                     "drafts greedily)")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process inherits it
    from megatron_mtp.data.embedded import corpus_prefix, default_cache_dir
    from megatron_mtp.serving import prompts as serving_prompts
    from megatron_mtp.serving.engines import vllm_engine

    if not vllm_engine.available():
        raise SystemExit(f"no vLLM at {vllm_engine.python()}: run `bash tools/bootstrap --engine vllm`")
    iomp = vllm_engine.python().parent.parent / "lib" / "libiomp5.so"  # vLLM's intel-openmp
    if not args.no_iomp and not iomp.is_file():
        raise SystemExit(f"no {iomp} (vLLM's intel-openmp); --no-iomp runs the engine without it")
    scratch = None if args.work else tempfile.TemporaryDirectory(prefix="vllm-bench-")
    work = Path(args.work or scratch.name)
    if (work / "hf").exists():
        raise SystemExit(f"--work {work} already holds an export (hf): give a new directory")
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(args.checkpoint) if args.checkpoint else work / "trained"
    if not args.checkpoint:
        train(checkpoint, args.train_iters, args.train_ranks)
    export(checkpoint, work / "hf")
    config = json.loads((work / "hf" / "config.json").read_text())
    prefix = str(corpus_prefix(default_cache_dir()))
    pairs = serving_prompts.dataset_prompts(prefix, args.prompts, args.prompt_offset + args.prompt_length,
                                            args.new_tokens)
    prompts = [[int(t) for t in prompt[args.prompt_offset:]] for prompt, _ in pairs]
    print(f"{checkpoint}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocabulary "
          f"{config['vocab_size']}; vLLM {args.threads} thread(s), "
          f"{'without Intel OpenMP' if args.no_iomp else 'Intel OpenMP preloaded'}; {args.prompts} prompts of "
          f"{args.prompt_length} bytes at byte {args.prompt_offset} of documents of {prefix}, {args.new_tokens} "
          f"new tokens, {f'temperature {args.temperature}' if args.temperature else 'greedy'}; {args.rounds} rounds",
          flush=True)

    if not args.no_iomp:  # the engine inherits this process's environment; this process has already started
        os.environ["LD_PRELOAD"] = " ".join(filter(None, (os.environ.get("LD_PRELOAD"), str(iomp))))
    # a side: (depth, draft mode); plain decoding is depth 0
    sides = ((0, None), *((depth, mode) for depth in DEPTHS for mode in args.draft_sample_methods))
    runs = {(side, batch): [] for side in sides for batch in args.batch_sizes}
    with open(work / "engine.log", "w") as log:
        for _ in range(args.rounds):
            for side in sides:
                depth, mode = side
                spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": depth,
                                               "draft_sample_method": mode}} if depth else {}
                with vllm_engine.Engine(work / "hf", log=log, **spec) as engine:
                    engine.generate(prompts[:max(args.batch_sizes)], 8)  # warm-up
                    for batch in args.batch_sizes:
                        runs[side, batch].append(decode(engine, prompts, args.new_tokens, batch, args.temperature))
    (work / "outputs.json").write_text(json.dumps({"prompts": prompts, "outputs": {
        f"{depth} {mode} {batch}": [run["outputs"] for run in rounds]
        for ((depth, mode), batch), rounds in runs.items()}}))
    report(runs, sides, args)
    plain = runs[(0, None), args.batch_sizes[0]][0]["outputs"]
    share = statistics.mean(repeated_share(p, o) for p, o in zip(prompts, plain, strict=True))
    print(f"plain outputs: {share:.2f} of the generated tokens end an 8-gram already in the text; prompt 0 and "
          f"its continuation: {bytes(prompts[0]).decode(errors='replace')!r} -> "
          f"{bytes(t for t in plain[0] if t < 256).decode(errors='replace')!r}")
    if scratch is not None:
        scratch.cleanup()


def report(runs: dict, sides: tuple, args) -> None:
    tokens = args.prompts * args.new_tokens
    sampled = args.temperature > 0

    def name(depth, mode):
        return "plain" if not depth else f"MTP D = {depth}" + (f", {mode} drafts" if sampled else "")

    cost = {}  # batch 1: the engine's CPU seconds per step (plain: per token; speculative: per verify step)
    print("| batch | decoding | tokens/s (wall) | speed-up, wall (rounds' range) | speed-up, engine CPU time |"
          " acceptance per position | mean acceptance length | outputs equal plain's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in args.batch_sizes:
        plain_rounds = runs[(0, None), batch]
        plain = plain_rounds[0]["outputs"]
        for side in sides:
            depth = side[0]
            rounds = runs[side, batch]
            # each round's ratio (its engines ran one after another, under the same load), then the median
            speedups = {clock: [p[clock] / run[clock] for p, run in zip(plain_rounds, rounds, strict=True)]
                        for clock in ("seconds", "cpu")}
            wall = statistics.median(speedups["seconds"])
            if sampled:  # lossless in distribution only: nothing to compare token for token
                equal = "-"
            else:
                differences = sorted({(i, at) for run in rounds
                                      for i, (out, ref) in enumerate(zip(run["outputs"], plain, strict=True))
                                      if (at := first_difference(out, ref)) is not None})
                equal = f"no: {len(differences)} (prompt, token) {differences}" if differences else "yes"
            # the rounds' counts summed (sampled rounds differ; greedy ones repeat)
            counts = {"drafts": sum(run["spec_decode"].get("drafts", 0) for run in rounds),
                      "accepted tokens": sum(run["spec_decode"].get("accepted tokens", 0) for run in rounds),
                      "accepted per position": [sum(run["spec_decode"]["accepted per position"][k] for run in rounds)
                                                for k in range(depth)]}
            steps = counts["drafts"] if depth else tokens * len(rounds)
            cost[side, batch] = sum(run["cpu"] for run in rounds) / steps
            per_position = " / ".join(f"{n / steps:.3f}" for n in counts["accepted per position"])
            length = f"{1 + counts['accepted tokens'] / steps:.3f}" if depth else ""
            print(f"| {batch} | {name(*side)} | {tokens / statistics.median(run['seconds'] for run in rounds):.1f} |"
                  f" {wall:.3f} ({min(speedups['seconds']):.3f}-{max(speedups['seconds']):.3f}) |"
                  f" {statistics.median(speedups['cpu']):.3f} | {per_position} | {length} | {equal} |", flush=True)
    if 1 in args.batch_sizes:
        target = cost[(0, None), 1]
        for mode in sorted({mode for _, mode in sides if mode}):
            verify = {d: cost[(d, mode), 1] for d in DEPTHS}
            draft = verify[2] - verify[1]
            print(f"batch 1{f', {mode} drafts' if sampled else ''}, the engine's CPU time per step: plain (one "
                  f"target step) {target * 1000:.2f} ms; verify step (the target over 1 + D positions and D draft "
                  f"steps) D = 1 {verify[1] * 1000:.2f} ms, D = 2 {verify[2] * 1000:.2f} ms; their difference, one "
                  f"draft step and one more position in the target's forward: {draft * 1000:.2f} ms = "
                  f"{draft / target:.2f} of a target step")


if __name__ == "__main__":
    main()
