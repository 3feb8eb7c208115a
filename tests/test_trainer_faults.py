# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py under faults and bad input.

- Bad input fails before anything is built, in one line: every refusal (also a --save
  directory holding checkpoints the run would overwrite) is checked in one process
  (tests/harness/argument_cases.py), and once under torchrun with two ranks, where
  the line must appear once, with no traceback from any rank.
- SIGTERM to the training processes saves a checkpoint and exits with status 0; the run
  resumes from it.
- kill -9 during a save (after the tensor files, before the tracker names them; and
  inside the tracker's replacement) leaves the previous checkpoint named and loadable, and
  the run resumes from it to the end.
- Resuming into another model shape is refused, naming each difference; isolation on or
  off is not a shape (the same checkpoint, optimizer included, loads either way).
- A damaged checkpoint (truncated tensor file, unreadable index, garbage in the tracker)
  is named in one line.
- Every file and directory of a checkpoint, the tracker included, takes the umask's mode, so
  another user of a shared run directory can resume, export or evaluate it.
"""

import json
import os
import shutil
import signal
import time

import pytest

from tests.harness import argument_cases
from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import TINY, Run, finish, last_rank_output, start, torchrun_workers, train

pytestmark = pytest.mark.slow

RUN = TINY + ("--lr", "1e-3", "--mtp-num-layers", "2")


# the corpus of the dataset fixture (tests/conftest.py)
CORPUS = "paragraphs"


@pytest.fixture(scope="module")
def checkpoint(dataset, tmp_path_factory):
    """A run of 4 iterations saved at 2 and 4."""
    root = tmp_path_factory.mktemp("checkpoint")
    train(2, *RUN, "--data-path", str(dataset), "--train-iters", "4", "--save", str(root), "--save-interval", "2")
    return root


def tracked(directory) -> str:
    return (directory / "latest_checkpointed_iteration.txt").read_text().strip()


# ---------------------------------------------------------------- bad input

def refusals(dataset, checkpoint, tmp_path) -> list[tuple[list, dict, str]]:
    """(argv, environment, what the one-line error must say)"""
    other_tokenizer = tmp_path / "other"
    shutil.copy(f"{dataset}.bin", f"{other_tokenizer}.bin")
    shutil.copy(f"{dataset}.idx", f"{other_tokenizer}.idx")
    metadata = json.loads(open(f"{dataset}.json").read())
    metadata.update(tokenizer="other/tokenizer.json", vocab_size=32000, eod_id=2)
    open(f"{other_tokenizer}.json", "w").write(json.dumps(metadata))
    truncated = tmp_path / "truncated"
    shutil.copy(f"{dataset}.idx", f"{truncated}.idx")
    shutil.copy(f"{dataset}.json", f"{truncated}.json")
    with open(f"{dataset}.bin", "rb") as source, open(f"{truncated}.bin", "wb") as target:
        target.write(source.read()[:1000])
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    distcp = sorted((damaged / "iter_0000004").glob("*.distcp"))[-1]
    with open(distcp, "r+b") as file:
        file.truncate(100)
    unreadable = tmp_path / "unreadable"
    shutil.copytree(checkpoint, unreadable)
    (unreadable / "iter_0000002" / ".metadata").write_bytes(b"not a pickle")
    garbage = tmp_path / "garbage"
    shutil.copytree(checkpoint, garbage)
    (garbage / "latest_checkpointed_iteration.txt").write_text("")
    data = [*TINY, "--data-path", str(dataset), "--lr", "1e-3", "--train-iters", "4"]
    one, two, three = ({"WORLD_SIZE": "1", "RANK": "0"}, {"WORLD_SIZE": "2", "RANK": "0"},
                       {"WORLD_SIZE": "3", "RANK": "0"})
    return [
        # Megatron-LM's own checks (validate_args, TransformerConfig, the fork's MTP options),
        # in one line: this script repeats none of them
        # the frequent ones said in flags first, upstream's check kept beside the hint
        ([*data, "--hidden-size", "48", "--num-attention-heads", "3", "--tensor-model-parallel-size", "2"], two,
         "--tensor-model-parallel-size 2 does not divide --num-attention-heads 3: choose a tensor-parallel size "
         "that divides the heads (Megatron-LM: num_attention_heads (3) must be a multiple of "
         "tensor_model_parallel_size (2)"),
        ([*data, "--save", str(tmp_path / "never")], one,
         "--save needs --save-interval N (every N iterations a checkpoint) (Megatron-LM: assert args.save_interval "
         "is not None"),
        ([*data, "--num-attention-heads", "3"], one,
         "--hidden-size must be a multiple of --num-attention-heads (Megatron-LM: assert args.hidden_size % "
         "args.num_attention_heads == 0"),
        ([*data, "--seq-length", "4096"], one,
         "--seq-length 4096 exceeds --max-position-embeddings"),
        ([*data, "--global-batch-size", "6", "--micro-batch-size", "4"], one,
         "--global-batch-size 6 is not a multiple of --micro-batch-size 4 x data-parallel size 1"),
        ([*data, "--global-batch-size", "8", "--micro-batch-size", "2"], three,
         "--global-batch-size 8 is not a multiple of --micro-batch-size 2 x data-parallel size 3"),
        ([*data, "--tensor-model-parallel-size", "2"], three, "world size (3) is not divisible by total_model_size"),
        ([*data, "--train-iters", "0"], one, "--train-iters must be a positive integer, got 0"),
        ([*data, "--train-iters", "-5"], one, "--train-iters must be a positive integer, got -5"),
        ([*data, "--micro-batch-size", "0"], one, "--micro-batch-size must be a positive integer, got 0"),
        ([*data, "--hidden-size", "-64"], one, "--hidden-size must be a positive integer, got -64"),
        ([*data, "--eval-iters", "-1"], one, "--eval-iters must be >= 0, got -1"),
        ([*data, "--fp16", "--bf16"], one, "Megatron-LM refused the arguments: assert not args.bf16 (arguments.py:"),
        ([*data, "--mtp-num-layers", "0", "--mtp-detach-heads"], one,
         "mtp_detach_heads (--mtp-detach-heads) isolates MTP heads, but mtp_num_layers is not set"),
        ([*data, "--mtp-num-layers", "0", "--mtp-use-repeated-layer"], one,
         "mtp_use_repeated_layer (--mtp-use-repeated-layer) applies one MTP layer at every depth, but"),
        ([*data, "--mtp-num-layers", "1", "--sparse-loss-chunk-size", "0"], one,
         "sparse_loss_chunk_size (--sparse-loss-chunk-size) must be >= 1 rows, got 0"),
        ([*data, "--sparse-lm-loss", "--main-loss-level", "sequence"], one,
         "--sparse-lm-loss needs the token-level main loss"),
        ([*data, "--mtp-num-layers", "1", "--context-parallel-size", "3"], three,
         "--seq-length 64 does not split into 2 x --context-parallel-size = 6 equal chunks"),
        ([*data, "--reset-attention-mask"], one, "--reset-attention-mask is not supported: this trainer's attention"),
        ([*data, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--position-embedding-type",
          "learned_absolute"], two, "(MTP) is not supported with learned_absolute position embedding type"),
        ([*data, "--lr-warmup-iters", "10"], one, "--lr-warmup-iters 10 must be below the decay length"),
        ([*TINY, "--data-path", str(dataset), "--train-iters", "4"], one, "give --lr"),
        ([*data, "--save", str(tmp_path / "new")], one, "assert args.save_interval is not None (arguments.py:"),
        ([*data, "--load", str(tmp_path / "nowhere")], one, f"--load {tmp_path / 'nowhere'}: no such directory"),
        ([*data, "--data-path", str(tmp_path / "missing")], one,
         f"missing {tmp_path / 'missing'}.bin"),
        ([*data, "--data-path", str(truncated)], one,
         f"{truncated}.bin holds 1000 bytes"),
        ([*data, "--vocab-size", "1000"], one, "--vocab-size 1000 does not match the dataset's tokenizer bytes"),
        ([*data, "--data-path", "0.5", str(dataset), "0.5", str(other_tokenizer)], one,
         "the datasets were written with different tokenizers"),
        ([*data, "--load", str(damaged)], one, f"{distcp}: truncated"),
        # the way out of a damaged latest checkpoint: an earlier one, into a new --save (issue 41)
        ([*data, "--load", str(damaged)], one, f"to go on from an earlier checkpoint, give --load {damaged} "
         "--ckpt-step 2 --save NEW_DIRECTORY"),
        ([*data, "--load", str(unreadable), "--ckpt-step", "2"], one,
         f"{unreadable / 'iter_0000002' / '.metadata'}: unreadable"),
        ([*data, "--load", str(garbage)], one,
         f"{garbage / 'latest_checkpointed_iteration.txt'}: the checkpoint tracker holds ''"),
        # a --save directory holding checkpoints the run does not resume from (issue 16)
        ([*data, "--save", str(checkpoint), "--save-interval", "2"], one,
         f"--save {checkpoint} holds checkpoints up to iteration 4 that this run would overwrite (it loads none): "
         f"resume them with --load {checkpoint}, or give another --save"),
        ([*data, "--mtp-num-layers", "2", "--load", str(unreadable), "--save", str(checkpoint), "--save-interval", "2"],
         one,
         f"(it loads {unreadable})"),
        ([*data, "--mtp-num-layers", "2", "--load", str(checkpoint), "--save", str(checkpoint), "--save-interval", "2",
          "--ckpt-step", "2"], one, f"would overwrite (it resumes from iteration 2 (--ckpt-step)): keep --load "
         f"{checkpoint} --ckpt-step 2 and give another --save"),
        ([*data, "--load", str(checkpoint), "--save", str(checkpoint), "--save-interval", "2", "--finetune"], one,
         "would overwrite (--finetune restarts at iteration 0)"),
        ([*data, "--load", str(checkpoint), "--mtp-num-layers", "3"], one,  # before anything is built
         "mtp_num_layers: checkpoint 2, model 3"),
    ]


def test_bad_input_is_refused_in_one_line_before_anything_is_built(dataset, checkpoint, tmp_path):
    cases = refusals(dataset, checkpoint, tmp_path)
    good = [*TINY, "--data-path", str(dataset), "--lr", "1e-3", "--train-iters", "4"]
    controls = [{"argv": good, "env": {"WORLD_SIZE": "1", "RANK": "0"}},
                # what upstream accepts and this script once refused: query groups a divisor of TP
                {"argv": [*good, "--group-query-attention", "--num-query-groups", "1",
                          "--tensor-model-parallel-size", "2"], "env": {"WORLD_SIZE": "2", "RANK": "0"}}]
    given = [{"argv": argv, "env": env} for argv, env, _ in cases] + controls
    outcomes = argument_cases.check(given, timeout=600)
    assert len(outcomes) == len(given)
    assert all(outcome["accepted"] for outcome in outcomes[len(cases):]), outcomes[len(cases):]
    wrong = []  # every case that is not refused as expected, reported together
    for (argv, env, expected), outcome in zip(cases, outcomes[:len(cases)], strict=True):
        errors = outcome["errors"]
        if outcome["accepted"] or len(errors) != 1 or expected not in errors[0] \
                or any("Traceback" in line for line in outcome["stderr"]):
            wrong.append((expected, outcome))
    assert not wrong, "\n".join(f"want {expected!r}, got {outcome}" for expected, outcome in wrong)


# Every refusal that depends on the flags alone (docs/mtp-options.md, docs/training.md, docs/moe.md,
# docs/context-parallel.md, docs/architectures.md), tried on the embedded default as a new user would:
# (flags, world size, what the one-line error says). 0.16.1's own (the draft objectives, MTP with CP)
# run on that build (tests/in_build/test_mtp_layout_refusal.py's build) and are not in this checkout's.
FLAG_ONLY_REFUSALS = [
    # the MTP options (megatron.core.fork.mtp.options), refused when the config is built
    (("--mtp-loss-type", "tv"), 1, "mtp_loss_type='tv' trains the heads toward the main head's own distribution"),
    (("--mtp-loss-type", "kl"), 1, "mtp_loss_type='kl' trains the heads toward the main head's own distribution"),
    (("--mtp-loss-type", "e2e_tv"), 1, "mtp_loss_type='e2e_tv' trains the heads toward"),
    (("--mtp-loss-type", "mse", "--mtp-detach-heads"), 1, "mtp_loss_type (--mtp-loss-type) must be one of"),
    (("--mtp-draft-temperature", "0"), 1, "mtp_draft_temperature (--mtp-draft-temperature) must be > 0, got 0"),
    (("--mtp-draft-temperature", "-1"), 1, "mtp_draft_temperature (--mtp-draft-temperature) must be > 0, got -1"),
    (("--mtp-loss-scaling-factor", "-0.1"), 1, "mtp_loss_scaling_factor must be a number >= 0, got -0.1"),
    (("--mtp-num-layers", "0", "--mtp-detach-heads"), 1, "mtp_detach_heads (--mtp-detach-heads) isolates MTP heads"),
    (("--mtp-num-layers", "0", "--mtp-use-repeated-layer"), 1, "mtp_use_repeated_layer (--mtp-use-repeated-layer)"),
    (("--sparse-loss-chunk-size", "0"), 1, "sparse_loss_chunk_size (--sparse-loss-chunk-size) must be >= 1 rows"),
    # this script's checks (megatron_mtp.arguments, megatron_mtp.moe_arguments)
    (("--freeze-backbone",), 1, "--freeze-backbone trains the MTP heads only"),
    (("--sparse-lm-loss", "--main-loss-level", "sequence"), 1, "--sparse-lm-loss needs the token-level main loss"),
    (("--reset-attention-mask",), 1, "--reset-attention-mask is not supported"),
    (("--lr-warmup-iters", "400"), 1, "--lr-warmup-iters 400 must be below the decay length"),
    (("--context-parallel-size", "3"), 3, "--seq-length 128 does not split into 2 x --context-parallel-size = 6"),
    (("--hybrid-layer-pattern", "M*M*/*"), 1, "--hybrid-layer-pattern layers M need Transformer Engine"),
    (("--hybrid-layer-pattern", "*E*E/*"), 1, "--hybrid-layer-pattern has MoE layers 'E': give --num-experts"),
    (("--hybrid-layer-pattern", "*G*G/*"), 1, "Gated DeltaNet layers"),
    (("--num-experts", "2", "--moe-router-topk", "4"), 1, "--moe-router-topk 4 exceeds --num-experts 2"),
    (("--num-experts", "3", "--expert-model-parallel-size", "2"), 2, "--num-experts 3 is not divisible by"),
    (("--num-experts", "4", "--moe-permute-fusion"), 1, "--moe-permute-fusion needs a CUDA kernel"),
    (("--num-experts", "4", "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"),
     1, "the global balance loss (global_aux_loss) accumulates routing statistics"),
    # Megatron-LM's own (validate_args, TransformerConfig)
    (("--fp16", "--bf16"), 1, "assert not args.bf16"),
    (("--num-attention-heads", "3"), 1, "--hidden-size must be a multiple of --num-attention-heads"),
    (("--pipeline-model-parallel-size", "2", "--position-embedding-type", "learned_absolute"), 2,
     "(MTP) is not supported with learned_absolute position embedding type"),
]


def test_a_flag_only_refusal_prints_its_line_first_and_writes_nothing(tmp_path):
    """Issue 50: on a fresh --save and dataset cache, each refusal leaves no run directory, no
    TensorBoard events, no log file and no embedded corpus behind, and its line comes before
    Megatron-LM's argument list (printed only for accepted arguments), within the first lines."""
    given = [{"argv": ["--train-iters", "4", "--save", str(tmp_path / f"run{i}"), *flags],
              "env": {"WORLD_SIZE": str(world), "RANK": "0", "MEGATRON_MTP_CACHE": str(tmp_path / f"cache{i}")}}
             for i, (flags, world, _) in enumerate(FLAG_ONLY_REFUSALS)]
    accepted = {"argv": ["--train-iters", "4", "--save", str(tmp_path / "accepted")],
                "env": {"WORLD_SIZE": "1", "RANK": "0", "MEGATRON_MTP_CACHE": str(tmp_path / "accepted-cache")}}
    outcomes = argument_cases.check([*given, accepted], timeout=600)
    control = outcomes[-1]  # what an accepted run writes while its arguments are handled: the checks see it
    assert control["accepted"] and (tmp_path / "accepted" / "tensorboard").is_dir(), control
    assert any(path.suffix == ".bin" for path in (tmp_path / "accepted-cache").iterdir()), control
    assert any("------------------------ arguments ------------------------" in line for line in control["output"])
    wrong = []
    for i, ((flags, _, expected), outcome) in enumerate(zip(FLAG_ONLY_REFUSALS, outcomes[:-1], strict=True)):
        left = [str(path) for path in (tmp_path / f"run{i}", tmp_path / f"cache{i}") if path.exists()]
        first = [n for n, line in enumerate(outcome["output"]) if line.startswith("pretrain_gpt_mtp.py: error: ")]
        if outcome["accepted"] or len(outcome["errors"]) != 1 or expected not in outcome["errors"][0] or left \
                or first[0] > 5:
            wrong.append((flags, expected, left, outcome["output"][:8]))
    assert not wrong, "\n".join(map(str, wrong))


def test_the_issue_s_command_prints_one_line_and_leaves_no_run_directory(tmp_path):
    """The command of issue 50, launched as a user launches it (torchrun, the embedded default)."""
    run = train(1, "--train-iters", "2", "--mtp-loss-type", "tv", "--save", str(tmp_path / "att"), "--eval-iters", "0",
                cwd=tmp_path, script=str(REPO_ROOT / "pretrain_gpt_mtp.py"), check=False, timeout=120,
                env={"MEGATRON_MTP_CACHE": str(tmp_path / "cache")})
    assert run.returncode != 0 and len(run.errors()) == 1, run.tail()
    assert "add --mtp-detach-heads" in run.errors()[0]
    assert "arguments ---" not in run.output, run.tail()  # Megatron-LM's argument list: not printed
    assert sorted(path.name for path in tmp_path.iterdir()) == [], sorted(tmp_path.rglob("*"))


def test_under_torchrun_a_refusal_is_one_line_from_one_rank(dataset):
    run = train(2, *RUN, "--data-path", str(dataset), "--train-iters", "4", "--hidden-size", "48",
                "--num-attention-heads", "3",
                "--tensor-model-parallel-size", "2", check=False, timeout=120)
    assert run.returncode != 0
    assert len(run.errors()) == 1, run.output[-3000:]
    assert "num_attention_heads (3) must be a multiple of tensor_model_parallel_size (2)" in run.errors()[0]
    assert "[rank" not in run.output  # no rank's traceback


# ---------------------------------------------------------------- signals and kills

def wait_for_iteration(proc, log, iteration: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"iteration {iteration:8d}/" in last_rank_output(log):
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no iteration {iteration} within {timeout}s")


def test_sigterm_saves_and_exits_zero_then_the_run_resumes(dataset, tmp_path):
    save = tmp_path / "run"
    args = (*RUN, "--data-path", str(dataset), "--save", str(save), "--save-interval", "10000",
            "--exit-signal-handler")
    proc, log = start(2, *args, "--train-iters", "100000", log=tmp_path / "run.log")
    wait_for_iteration(proc, log, 3)
    workers = torchrun_workers(proc)
    assert len(workers) == 2, workers
    for worker in workers:  # what a scheduler does: every training process gets the signal
        worker.send_signal(signal.SIGTERM)
    run = finish(proc, log, timeout=120)
    assert run.returncode == 0, run.tail()
    assert "exiting program after receiving SIGTERM" in run.output
    stopped = int(tracked(save))
    assert stopped >= 3 and (save / f"iter_{stopped:07d}").is_dir()

    resumed = train(2, *args, "--train-iters", "100000", "--load", str(save), "--exit-interval", str(stopped + 2))
    assert sorted(resumed.iterations) == [stopped + 1, stopped + 2], resumed.tail()

    changed = train(2, *args, "--train-iters", "50", "--load", str(save), check=False)
    assert changed.returncode != 0 and len(changed.errors()) == 1, changed.tail()
    assert "do not match" in changed.errors()[0] and "--override-opt_param-scheduler" in changed.errors()[0]
    assert "[rank" not in changed.output


def stop_the_main_command(tmp_path, stop, **start_options) -> Run:
    """The README's main command (no flags: the embedded default, megatron_mtp.launch in torchrun's
    place) stopped by `stop(launcher)` at iteration 2 or later."""
    proc, log = start(2, "--train-iters", "100000", "--log-interval", "1", cwd=tmp_path,
                      script=str(REPO_ROOT / "pretrain_gpt_mtp.py"), log=tmp_path / "run.log",
                      launcher="megatron_mtp.launch", **start_options)
    wait_for_iteration(proc, log, 2)
    stop(proc)
    return finish(proc, log, timeout=120)


def test_ctrl_c_on_the_main_command_saves_and_it_exits_zero(tmp_path):
    """Ctrl-C: SIGINT to the terminal's process group (the launcher, its workers and their data
    loaders; fresh interpreters, as a user's). The workers take it as the exit signal and save, the
    launcher passes it on too and exits 0 (torchrun's own status is 1)."""
    run = stop_the_main_command(tmp_path, lambda proc: os.killpg(proc.pid, signal.SIGINT), fresh=True)
    assert run.returncode == 0 and "exiting program after receiving SIGTERM" in run.output, run.tail()
    assert "megatron_mtp.launch: stopped by SIGINT; every worker exited 0" in run.output, run.tail()
    assert int(tracked(tmp_path / "runs" / "default")) >= 2


@pytest.mark.matrix  # the default tier: Ctrl-C above (the launcher's status) and SIGTERM to the workers
def test_sigterm_to_the_main_command_s_launcher_saves_and_it_exits_zero(tmp_path):
    """A preemption that signals the launcher alone (`kill PID`, a container's stop): it passes the
    signal on, the workers save and exit 0, and so does the launcher."""
    run = stop_the_main_command(tmp_path, lambda proc: proc.send_signal(signal.SIGTERM))
    assert run.returncode == 0 and "exiting program after receiving SIGTERM" in run.output, run.tail()
    assert "megatron_mtp.launch: stopped by SIGTERM; every worker exited 0" in run.output, run.tail()
    assert int(tracked(tmp_path / "runs" / "default")) >= 2


@pytest.mark.parametrize("moment", [pytest.param("after-tensor-files", marks=pytest.mark.matrix), "replacing-tracker"])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(moment, dataset, tmp_path):
    save = tmp_path / "run"
    args = (*RUN, "--data-path", str(dataset), "--save", str(save), "--save-interval", "2", "--train-iters", "6")
    killed = train(2, *args, script="tests/harness/kill_during_save.py", check=False,
                   env={"KILL_DURING_SAVE": moment, "KILL_AT_ITERATION": "4"})
    assert killed.returncode != 0
    assert "killed during the save of iteration 4" in killed.output, killed.tail()
    assert tracked(save) == "2"  # the tracker still names the previous, complete checkpoint

    resumed = train(2, *args, "--load", str(save))
    assert sorted(resumed.iterations) == [3, 4, 5, 6], resumed.tail()
    assert tracked(save) == "6"


def test_every_checkpoint_file_takes_the_umask_s_mode(checkpoint):
    umask = os.umask(0)
    os.umask(umask)  # the trainer's processes inherited this one
    modes = {path.relative_to(checkpoint).as_posix(): (path.stat().st_mode & 0o777, 0o777 if path.is_dir() else 0o666)
             for path in checkpoint.rglob("*")}  # not the directory itself, which pytest made private
    assert "latest_checkpointed_iteration.txt" in modes and "iter_0000004/.metadata" in modes, sorted(modes)
    wrong = {name: oct(mode) for name, (mode, full) in modes.items() if mode != full & ~umask}
    assert not wrong, (oct(umask), wrong)


# ---------------------------------------------------------------- shape and damage

def test_resuming_into_another_shape_is_refused_naming_each_difference(dataset, checkpoint):
    run = train(2, *RUN, "--data-path", str(dataset), "--train-iters", "6", "--load", str(checkpoint),
                "--mtp-num-layers", "3", "--mtp-use-repeated-layer", "--qk-layernorm", "--attention-output-gate",
                check=False)
    assert run.returncode != 0
    (error,) = run.errors()
    assert "mtp_num_layers: checkpoint 2, model 3" in error and "mtp_use_repeated_layer: checkpoint False, " \
        "model True" in error, error
    assert "qk_layernorm: checkpoint False, model True" in error, error  # the attention's fields too (issue 27)
    assert "attention_output_gate: checkpoint False, model True" in error, error
    assert "[rank" not in run.output


def test_isolation_is_not_a_shape(dataset, checkpoint):
    run = train(2, *RUN, "--data-path", str(dataset), "--train-iters", "4", "--load", str(checkpoint),
                "--ckpt-step", "2", "--mtp-detach-heads")
    assert sorted(run.iterations) == [3, 4] and "mtp grad norm" in run.iterations[4], run.tail()
