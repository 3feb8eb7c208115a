# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The Hugging Face families are one adapter each, in megatron_mtp/serving/families/, and the
registry there is the only place that lists them: the docs' table names every registered family,
every file there is one, the generic serving code names none, and a family registered from
outside (as a new file would be) is imported, exported and offered by convert_checkpoint.py
without a change elsewhere. One process, no launch.
"""

import io
import re
import tokenize
from pathlib import Path

import pytest

from megatron_mtp.serving import export, families
from megatron_mtp.serving.config import ModelConfig
from megatron_mtp.serving.families.llama import Llama
from tests.harness.launcher import REPO_ROOT

SERVING = Path(REPO_ROOT) / "megatron_mtp" / "serving"
_COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6, hidden_act="silu")
_SOFTMAX = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
_SIGMOID = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1)
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, full_attention_interval=2, head_dim=8)
# A small config.json of each family (a new family adds its own here: test_every_family_has_a_sample)
SAMPLES = {
    "llama": {},
    "qwen2": {},
    "mimo": {},
    "qwen3": {},
    "qwen3_moe": _SOFTMAX,
    "deepseek_v3": dict(_SIGMOID, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                        v_head_dim=8),
    "glm4_moe": dict(_SIGMOID, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5),
    "qwen3_next": dict(_SOFTMAX, **_GDN, shared_expert_intermediate_size=16),
    "qwen3_5": _GDN,
    "qwen3_5_moe": dict(_SOFTMAX, **_GDN, shared_expert_intermediate_size=16),
}


def _config_json(name: str) -> dict:
    return dict(_COMMON, **SAMPLES[name], architectures=[families.FAMILIES[name].architecture])


def _docs_table() -> list:
    """The rows of docs/serving.md's "Hugging Face families" table, as cells."""
    text = (Path(REPO_ROOT) / "docs" / "serving.md").read_text()
    section = text.split("\n## Hugging Face families\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]


def test_the_docs_table_lists_every_registered_family_as_its_adapter_says():
    expected = []
    for family in families.FAMILIES.values():
        published = family.published_experts
        expected.append([family.name, family.architecture,
                         "megatron_mtp/serving/families/" + type(family).__module__.rsplit(".", 1)[1] + ".py",
                         family.mtp_layout, " / ".join(published) if published else "-"])
    table = _docs_table()
    assert [row[:5] for row in table] == expected
    # and, for each, whether it ran in vLLM's CPU build here, or the measured reason why not
    assert all(len(row) == 6 and row[5] for row in table), table


def test_every_file_in_families_is_a_registered_family():
    files = {path.stem for path in (SERVING / "families").glob("*.py")} - {"__init__", "base"}
    registered = {type(family).__module__.rsplit(".", 1)[1] for family in families.FAMILIES.values()}
    assert files == registered
    assert all(family.mtp_layout in families.MTP_LAYOUTS for family in families.FAMILIES.values())
    assert all(family.same_shape_as in families.FAMILIES for family in families.FAMILIES.values()
               if family.same_shape_as)
    titles = [getattr(family, "title", None) for family in families.FAMILIES.values()]  # messages name them
    assert all(isinstance(title, str) and title for title in titles) and len(set(titles)) == len(titles), titles


def _names() -> set:
    """Every name that identifies a family: its key, its classes, the MTP layouts' names."""
    names = set(families.FAMILIES) | set(families.BY_ARCHITECTURE) | set(families.VLM_WRAPPERS)
    return names | set(families.MTP_LAYOUTS)


def test_the_generic_serving_code_names_no_family():
    """serving/*.py outside families/ (code, comments and docstrings) holds no family's key or class,
    and convert_checkpoint.py no string that is one (its choices come from the registry)."""
    word = re.compile(r"\b(" + "|".join(sorted(map(re.escape, _names()), key=len, reverse=True)) + r")\b")
    found = [f"{path.name}:{number}: {match.group(0)}" for path in sorted(SERVING.glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) for match in word.finditer(line)]
    tool = (Path(REPO_ROOT) / "tools" / "convert_checkpoint.py").read_text()
    for token in tokenize.generate_tokens(io.StringIO(tool).readline):
        if token.type == tokenize.STRING and token.string.strip("\"'") in _names():
            found.append(f"convert_checkpoint.py:{token.start[0]}: {token.string}")
    assert found == []


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_family_reads_and_writes_its_own_config_json(name):
    """Its config.json read and written back names it; its import's arguments export as it; a trained
    run of its shape (no family recorded) exports as the family that claims the shape."""
    family = families.FAMILIES[name]
    cfg = ModelConfig.from_hf(_config_json(name))
    assert cfg.family == name and cfg.adapter is family
    written = cfg.to_hf("fp32", None)
    assert written["architectures"] == [family.architecture] and written["model_type"] == family.hf_model_type
    assert ModelConfig.from_hf(written).to_hf("fp32", None) == written
    args = cfg.megatron_args()
    assert export.plan(args).cfg.family == name
    args.serving_family = None
    assert export.plan(args).cfg.family == (family.same_shape_as or name)


def test_every_family_has_a_sample():
    assert list(SAMPLES) == list(families.FAMILIES)


class _Toy(Llama):
    """A new family as its file would define it: Llama's model under another class."""

    name = "toy"
    architecture = "ToyForCausalLM"
    same_shape_as = "llama"


def test_a_family_registered_from_its_own_file_is_read_written_and_offered(monkeypatch):
    for registry in ("FAMILIES", "BY_ARCHITECTURE", "VLM_WRAPPERS", "MTP_LAYOUTS"):
        monkeypatch.setattr(families, registry, dict(getattr(families, registry)))
    families.register(_Toy())
    cfg = ModelConfig.from_hf(dict(_COMMON, architectures=["ToyForCausalLM"]))
    assert cfg.family == "toy" and cfg.to_hf("bf16", None)["architectures"] == ["ToyForCausalLM"]
    assert export.plan(cfg.megatron_args()).cfg.family == "toy"  # the import's family, recorded
    assert export.plan(cfg.megatron_args(), architecture="llama").cfg.family == "llama"
    trained = ModelConfig.from_hf(dict(_COMMON, architectures=["LlamaForCausalLM"])).megatron_args()
    assert export.plan(trained, architecture="toy").cfg.family == "toy"
    from tools import convert_checkpoint

    assert convert_checkpoint.parse(["export", "in", "out", "--architecture", "toy"]).architecture == "toy"


# What a trained run with MTP depths exports as by default: (family written, MTP layout written); None:
# the backbone alone (no vLLM model drafts for the family's class, and vLLM's loader refuses tensors its
# model lacks: `There is no module or parameter named 'mtp_layers' in LlamaModel`, run here)
DRAFTED = {"llama": ("llama", None), "qwen2": ("mimo", "mimo"), "qwen3": ("qwen3", None),
           "qwen3_moe": ("qwen3_moe", None), "deepseek_v3": ("deepseek_v3", "deepseek_v3"),
           "glm4_moe": ("glm4_moe", "deepseek_v3"), "qwen3_next": ("qwen3_next", "qwen3_next"),
           "qwen3_5": ("qwen3_5", "qwen3_next")}


@pytest.mark.parametrize("name", list(DRAFTED))
def test_an_export_with_mtp_depths_loads_in_vllm_as_written(name):
    assert sorted(DRAFTED) == sorted(n for n, f in families.FAMILIES.items() if not f.same_shape_as)
    args = ModelConfig.from_hf(_config_json(name)).megatron_args()
    args.serving_family, args.mtp_num_layers = None, 2  # a trained run of the family's shape
    planned = export.plan(args)
    assert (planned.cfg.family, planned.layout) == DRAFTED[name], planned
    own = families.FAMILIES[name]
    if planned.layout is None:  # said, with the way to write them anyway
        assert f"--mtp-layout {own.mtp_layout} writes them anyway" in planned.note
        assert export.plan(args, mtp_layout=own.mtp_layout).layout == own.mtp_layout
    elif planned.cfg.family != name:  # said, with the way to write the shape's own class
        assert f"--architecture {name} writes {own.architecture} without them" in planned.note
        assert export.plan(args, architecture=name).layout is None
    else:
        assert planned.note is None and planned.cfg.adapter.drafter
