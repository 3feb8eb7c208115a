"""From training to serving: tools/convert_checkpoint.py and tools/eval_speculative.py.

One module-scoped pipeline, so megatron-core is imported in few processes:
1. tiny random Llama (tied, Llama 3 RoPE scaling) and Qwen2 (untied, QKV biases, one MiMo MTP
   depth) checkpoints written by `transformers`, and two constructed Qwen2 "counting" models,
   imported (the Qwen2 one with a second, new MTP depth);
2. pretrain_gpt_mtp.py --load the imported Qwen2 --finetune --freeze-backbone --mtp-detach-heads
   at TP = 2 x PP = 2 (D = 2), 4 iterations;
3. one process checks: parity with transformers and with plain-PyTorch MiMo / DeepSeek-V3 MTP
   forwards, the loaders' tensor names, round trips, the frozen backbone, speculative decoding.
Bad input runs the command line, one subprocess per case.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launcher import REPO_ROOT, launch
from tests.harness.trainer import TINY, train

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

PARITY = 1e-5  # relative, fp32


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    prepared = launch("tests.bodies.serving:prepare", 1, {"root": str(root)}, timeout=300)[0]
    train(4, *TINY, *prepared["flags"], "--load", str(root / "qwen-mg"), "--finetune", "--freeze-backbone",
          "--mtp-detach-heads", "--mtp-num-layers", "2", "--tensor-model-parallel-size", "2",
          "--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64", "--train-iters", "4",
          "--lr", "3e-3", "--save", str(root / "trained"), "--save-interval", "4", timeout=400)
    results = launch("tests.bodies.serving:check", 1, {"root": str(root)}, timeout=400)[0]
    return root, results


def test_imported_models_compute_what_transformers_computes(pipeline):
    _, results = pipeline
    parity = results["parity"]
    for name in ("llama logits", "qwen logits", "mimo backbone logits", "deepseek_v3 backbone logits"):
        assert parity[name] <= PARITY, (name, parity[name])


def test_exported_mtp_depths_compute_mimo_and_deepseek_mtp_forwards(pipeline):
    _, results = pipeline
    parity = results["parity"]
    for layout in ("mimo", "deepseek_v3"):
        for depth in (1, 2):
            assert parity[f"{layout} depth {depth} logits"] <= PARITY, (layout, depth, parity)


def test_exported_names_are_the_loaders(pipeline):
    _, results = pipeline
    assert set(results["names"]) == {"mimo", "deepseek_v3"}


def test_round_trips_are_bit_identical(pipeline):
    root, results = pipeline
    trips = results["round trips"]
    assert trips["qwen import-export tensors"] > 0 and trips["llama import-export tensors"] > 0
    assert trips["mimo export-import tensors"] == trips["deepseek_v3 export-import tensors"] > 0
    flags = (root / "qwen-mg" / "megatron_flags.txt").read_text().split()
    assert "--add-qkv-bias" in flags and "--untie-embeddings-and-output-weights" in flags
    config = json.loads((root / "export-mimo" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_nextn_predict_layers"] == 2
    assert not [p.name for p in root.iterdir() if ".partial-" in p.name]  # staging renamed or removed


def test_trainer_loads_the_import_at_tp2_pp2_with_the_backbone_frozen(pipeline):
    _, results = pipeline
    frozen = results["frozen backbone"]
    assert frozen["backbone tensors"] > 0 and frozen["mtp tensors changed"] > 0


def test_speculative_decoding_constructed_models(pipeline):
    _, results = pipeline
    perfect, wrong = results["speculative"]["counting"], results["speculative"]["counting-wrong"]
    assert perfect["acceptance per depth (vLLM per-position rate)"] == [1.0, 1.0]
    assert perfect["draft acceptance rate"] == 1.0
    assert perfect["mean acceptance length incl. bonus (vLLM)"] == 3.0
    assert perfect["teacher-forced acceptance per depth"] == [1.0, 1.0]
    assert perfect["target forwards per generated token"] < 0.5
    assert wrong["acceptance per depth (vLLM per-position rate)"] == [0.0, 0.0]
    assert wrong["mean acceptance length incl. bonus (vLLM)"] == 1.0
    assert wrong["target forwards per generated token"] == 1.0


def test_eval_speculative_on_a_trained_checkpoint_is_lossless(pipeline):
    _, results = pipeline
    run = results["evaluate"]
    summary = run["results"]
    assert run["status"] == 0 and summary["lossless"] and summary["prompts"] == 4
    per_depth = summary["acceptance per depth (vLLM per-position rate)"]
    assert len(per_depth) == 2 and all(0.0 <= rate <= 1.0 for rate in per_depth)
    assert per_depth[1] <= per_depth[0]  # position 2 is accepted only after position 1
    assert 1.0 <= summary["mean acceptance length incl. bonus (vLLM)"] <= 3.0
    assert summary["accept length incl. bonus (SGLang)"] == summary["mean acceptance length incl. bonus (vLLM)"]
    assert 1 / 3 <= summary["target forwards per generated token"] <= 1.0
    assert all(0.0 <= rate <= 1.0 for rate in summary["teacher-forced acceptance per depth"])


# ---------------------------------------------------------------- bad input

def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_checkpoint.py"), *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def refused(run: subprocess.CompletedProcess, words: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("convert_checkpoint.py: error: ") and words in lines[0], lines


def damaged(pipeline, tmp_path, name: str, edit) -> Path:
    """A copy of the imported Qwen2 Hugging Face checkpoint, changed by `edit(config, tensors)`."""
    from safetensors.torch import load_file, save_file

    root, _ = pipeline
    config = json.loads((root / "qwen" / "config.json").read_text())
    tensors = load_file(str(root / "qwen" / "model.safetensors"))
    edit(config, tensors)
    target = tmp_path / name
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_bad_input_is_one_line_and_writes_nothing(pipeline, tmp_path):
    root, _ = pipeline

    def architecture(config, tensors):
        config["architectures"] = ["GPT2LMHeadModel"]

    def missing(config, tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]

    def misnamed(config, tensors):
        tensors["model.layers.1.mlp.upproj.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")

    def shape(config, tensors):
        config["intermediate_size"] = 128

    cases = {"architecture": (architecture, "unknown architecture"),
             "missing": (missing, "missing tensor model.layers.1.mlp.up_proj.weight"),
             "misnamed": (misnamed, "model.layers.1.mlp.upproj.weight"),
             "shape": (shape, "config.json implies")}
    for name, (edit, words) in cases.items():
        source = damaged(pipeline, tmp_path, name, edit)
        out = tmp_path / f"out-{name}"
        refused(cli("import", str(source), str(out)), words)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name], name

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    refused(cli("export", str(root / "trained"), str(busy)), "already holds files")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]

    out = tmp_path / "out-no-mtp"
    refused(cli("export", str(root / "llama-mg"), str(out), "--mtp-layout", "mimo"), "has no MTP depths")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
