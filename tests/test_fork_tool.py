# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""tools/fork: every carried series applies to its pristine upstream, export reproduces it
byte for byte, and every failure the issues name gives a clear error instead of a traceback."""

import ast
import hashlib
import os
import re
import subprocess
import symtable
import sys
import tarfile
from pathlib import Path

import pytest

from megatron_mtp.patched_core import (
    BUILD_DIR,
    REPO_ROOT,
    carried_versions,
    current_upstream_version,
    series_dir,
    series_patches,
)
from tests.harness.checkout import applied_checkout, edited_checkout, pristine_checkout

PARTS = ("runtime", "fixes", "mtp", "training-loop")
VERSIONS = carried_versions()
CURRENT = current_upstream_version()
OLDEST = VERSIONS[-1]


def fork(*args, env=None, check_rc=None):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "fork"), *map(str, args)],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if check_rc is not None:
        assert result.returncode == check_rc, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result


def sdist_of(version: str) -> Path:
    path = BUILD_DIR / "downloads" / f"megatron_core-{version}.tar.gz"
    if not path.is_file():  # bootstrap downloads them; fetch it if this checkout never built
        fork("check", "--version", version, check_rc=0)
    return path


@pytest.mark.parametrize("version", VERSIONS)
def test_check_applies_every_patch_to_pristine_upstream(version):
    result = fork("check", "--version", version, "--sdist", sdist_of(version), check_rc=0)
    for patch in series_patches(version):
        assert f"{patch.name}: ok" in result.stdout


@pytest.mark.parametrize("version", VERSIONS)
def test_prepare_then_export_reproduces_the_committed_series_byte_for_byte(version, tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    fork("prepare", "--version", version, "--workdir", tree, "--sdist", sdist_of(version), check_rc=0)
    commits = subprocess.run(["git", "-C", tree, "rev-list", "--count", "upstream..HEAD"],
                             capture_output=True, text=True).stdout.strip()
    assert int(commits) == len(series_patches(version))  # one commit per patch
    fork("export", "--version", version, "--workdir", tree, "--out", out, check_rc=0)
    committed = series_dir(version)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in committed.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (committed / path.name).read_bytes(), f"{path.name} drifted"


@pytest.mark.parametrize("version", VERSIONS)
def test_patch_headers_are_dep3_with_one_author_and_one_part(version):
    kinds = []
    for patch in series_patches(version):
        text = patch.read_text()
        header = text[:text.index("\n---\n")]
        assert "From: Megatron-MTP <megatron-mtp@users.noreply.localhost>" in header, patch.name
        assert "\nForwarded: " in header, f"{patch.name}: no DEP-3 Forwarded field"
        parts = re.findall(r"^Part: (.*)$", header, re.M)
        assert len(parts) == 1 and parts[0] in PARTS, (patch.name, parts)
        kinds.append(parts[0])
        added = [line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
        assert all(len(line) <= 100 for line in added), f"{patch.name}: a line longer than upstream's 100"
    runtime = kinds.count("runtime")
    assert runtime and kinds[:runtime] == ["runtime"] * runtime, kinds  # the runtime part first


def test_prepare_refuses_a_dirty_working_tree(tmp_path):
    tree = tmp_path / "tree"
    fork("prepare", "--workdir", tree, "--sdist", sdist_of(CURRENT), check_rc=0)
    (tree / "megatron" / "core" / "parallel_state.py").write_text("# edited\n")
    result = fork("prepare", "--workdir", tree, "--sdist", sdist_of(CURRENT), check_rc=2)
    assert "uncommitted changes" in result.stderr
    assert (tree / "megatron" / "core" / "parallel_state.py").read_text() == "# edited\n"  # nothing lost


def test_unknown_version_is_a_clear_error():
    result = fork("check", "--version", "9.9.9", check_rc=2)
    assert ("no patch series for megatron-core 9.9.9" in result.stderr
            or "unknown megatron-core version" in result.stderr)


def test_hash_mismatch_is_a_clear_error(tmp_path):
    fake = tmp_path / f"megatron_core-{CURRENT}.tar.gz"
    fake.write_bytes(b"not the release")
    result = fork("check", "--sdist", fake, check_rc=2)
    assert "sha256 mismatch" in result.stderr


def test_no_network_is_a_clear_error_with_pips_reason(tmp_path):
    env = dict(os.environ, MEGATRON_MTP_DOWNLOADS=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    result = fork("check", env=env, check_rc=2)
    assert "could not download" in result.stderr and "no network" in result.stderr
    assert "Could not find a version that satisfies the requirement" in result.stderr  # pip's reason, kept


def test_a_release_requiring_a_newer_python_downloads(tmp_path):
    """megatron-core 0.17+ declares Requires-Python >= 3.12; its source is fetched anyway
    (it is patched, verified and built, not installed as a wheel) and matches the pin."""
    newest = VERSIONS[0]
    env = dict(os.environ, MEGATRON_MTP_DOWNLOADS=str(tmp_path))
    fork("check", "--version", newest, env=env, check_rc=0)
    assert (tmp_path / f"megatron_core-{newest}.tar.gz").read_bytes() == sdist_of(newest).read_bytes()


@pytest.mark.parametrize("version", [VERSIONS[0], *(pytest.param(v, marks=pytest.mark.matrix) for v in VERSIONS[1:])])
def test_check_reports_the_patch_and_file_that_do_not_apply_to_a_checkout(version, tmp_path):
    checkout = pristine_checkout(sdist_of(version), tmp_path / "lm")
    fork("check", "--version", version, "--sdist", sdist_of(version), "--checkout", checkout, check_rc=0)
    target = checkout / "megatron" / "core" / "optimizer" / "grad_scaler.py"
    target.write_text(target.read_text().replace("device='cuda'", "device='cuda:0'"))
    result = fork("check", "--version", version, "--sdist", sdist_of(version), "--checkout", checkout, check_rc=1)
    failing = next(p.name for p in series_patches(version) if "grad-scaler" in p.name)
    assert f"{failing}: FAILED" in result.stdout
    assert "megatron/core/optimizer/grad_scaler.py" in result.stdout


def test_check_of_a_checkout_of_another_version_says_so_in_one_line(tmp_path):
    checkout = pristine_checkout(sdist_of(OLDEST), tmp_path / "lm")
    result = fork("check", "--version", CURRENT, "--sdist", sdist_of(CURRENT), "--checkout", checkout, check_rc=2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"is megatron-core {OLDEST}, but this series is for {CURRENT}" in lines[0]
    assert f"--version {OLDEST}" in lines[0]  # a carried version: the series to use


def test_export_for_users_never_deletes_files_it_did_not_write(tmp_path):
    out = tmp_path / "series"
    out.mkdir()
    mine = out / "0001-my-own-work.patch"
    mine.write_text("a user's patch\n")
    result = fork("export", "--for-users", out, "--sdist", sdist_of(CURRENT), check_rc=2)
    assert "did not write" in result.stderr and "0001-my-own-work.patch" in result.stderr
    assert mine.read_text() == "a user's patch\n" and sorted(p.name for p in out.iterdir()) == [mine.name]

    fresh = tmp_path / "fresh"
    fork("export", "--for-users", fresh, "--sdist", sdist_of(CURRENT), check_rc=0)
    names = (fresh / "series").read_text().split()
    # the fork-owned modules first, the trainer (pretrain_gpt_mtp.py and megatron_mtp) last
    assert len(names) == len(series_patches(CURRENT)) + 2 and "fork-owned" in names[0]
    assert "pretrain_gpt_mtp" in names[-1]
    fork("export", "--for-users", fresh, "--sdist", sdist_of(CURRENT), check_rc=0)  # its own: replaced
    assert (fresh / "series").read_text().split() == names


def undefined_globals(source: str) -> set:
    """Names functions of a module read as globals that the module never binds (nor builtins
    hold): what a hunk calling a module its patch does not import leaves behind."""
    import builtins

    table = symtable.symtable(source, "module", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    bound |= {name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Global) for name in node.names}
    missing = set()

    def visit(scope):
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and symbol.is_global() and not symbol.is_declared_global():
                missing.add(symbol.get_name())
        for child in scope.get_children():
            visit(child)

    visit(table)
    return missing - bound - set(dir(builtins)) - {"__file__", "__name__", "__spec__"}


@pytest.mark.parametrize("version", VERSIONS)
def test_export_for_users_without_the_runtime_part_applies_to_pristine_upstream(version, tmp_path):
    """A GPU user's series: every patch but the runtime part's, moved onto pristine upstream.
    It applies with `git am`; outside the files the runtime part touches the tree is the whole
    series' byte for byte, and no hunk there calls a name its file does not bind."""
    whole, lean = tmp_path / "whole", tmp_path / "lean"
    fork("export", "--version", version, "--for-users", whole, "--sdist", sdist_of(version), check_rc=0)
    result = fork("export", "--version", version, "--for-users", lean, "--without", "runtime",
                  "--sdist", sdist_of(version), check_rc=0)
    assert "without the runtime part" in result.stdout
    runtime = [p for p in series_patches(version) if re.search(r"^Part: runtime$", p.read_text(), re.M)]
    headers = "".join((lean / name).read_text().split("\n---\n")[0] for name in (lean / "series").read_text().split())
    assert runtime and "\nPart: runtime\n" not in headers and "\nPart: mtp\n" in headers
    assert len((lean / "series").read_text().split()) == len((whole / "series").read_text().split()) - len(runtime)

    full_tree = applied_checkout(whole, sdist_of(version), tmp_path / "t-whole")
    lean_tree = applied_checkout(lean, sdist_of(version), tmp_path / "t-lean")
    pristine = pristine_checkout(sdist_of(version), tmp_path / "pristine")
    touched_by_runtime = {line.split(" b/")[0][len("diff --git a/"):] for p in runtime
                          for line in p.read_text().splitlines() if line.startswith("diff --git a/")}
    changed = subprocess.run(["git", "diff", "--name-only", "pristine", "HEAD"],
                             cwd=lean_tree, capture_output=True, text=True, check=True).stdout.split()
    assert changed
    for rel in changed:
        lean_file, full_file = lean_tree / rel, full_tree / rel
        if rel not in touched_by_runtime:
            assert lean_file.read_bytes() == full_file.read_bytes(), rel
        if rel.endswith(".py"):
            source = lean_file.read_text()
            before = (pristine / rel).read_text() if (pristine / rel).exists() else ""
            new = undefined_globals(source) - undefined_globals(before)
            assert not new, f"{rel}: {sorted(new)} used but not bound without the runtime part"


def test_without_names_a_part_and_needs_for_users(tmp_path):
    result = fork("export", "--without", "runtime", check_rc=2)
    assert "--for-users" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = fork("export", "--for-users", tmp_path / "x", "--without", "gpu", check_rc=2)
    assert "invalid choice: 'gpu'" in result.stderr and not (tmp_path / "x").exists()


def _variant_sdist(sdist: Path, tmp_path: Path, version: str, edit) -> tuple[Path, str]:
    """Repack a pristine sdist as `version` after `edit(tree_root)` changed some files."""
    root = tmp_path / f"src-{version}"
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    (tree,) = root.iterdir()
    edit(tree)
    out = tmp_path / f"megatron_core-{version}.tar.gz"
    with tarfile.open(out, "w:gz") as archive:
        archive.add(tree, arcname=f"megatron_core-{version}")
    return out, hashlib.sha256(out.read_bytes()).hexdigest()


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


def test_rebase_merges_a_later_patch_to_a_file_an_earlier_one_changed(tmp_path):
    """The tied-MTP-stage patch edits gpt_model.py after an earlier patch did. Upstream changed
    a line of its context, so `git am` must 3-way merge it, from the blob that exists only
    after the earlier patches: the old series' commits have to be there."""
    patches = series_patches(CURRENT)
    tied = next(p for p in patches if "tied-MTP" in p.name)
    earlier = patches[:patches.index(tied)]
    assert any("megatron/core/models/gpt/gpt_model.py" in p.read_text() for p in earlier)

    def upstream_edit(tree):
        _replace(tree / "megatron/core/models/gpt/gpt_model.py", "                bias=False,\n",
                 "                bias=False,  # a comment added upstream\n")

    new_sdist, digest = _variant_sdist(sdist_of(CURRENT), tmp_path, "0.99.1", upstream_edit)
    out = tmp_path / "series-0.99.1"
    result = fork("rebase", "--version", CURRENT, "--onto", "0.99.1", "--sdist", new_sdist, "--sha256", digest,
                  "--workdir", tmp_path / "tree", "--out", out, check_rc=0)
    assert "wrote" in result.stdout
    assert (out / "series").read_text().split() == [p.name for p in patches]
    assert "a comment added upstream" in (out / tied.name).read_text()  # merged, not replaced


def test_rebase_stops_at_a_conflict_naming_patch_file_and_hunk(tmp_path):
    def conflict(tree):
        _replace(tree / "megatron/core/optimizer/grad_scaler.py",
                 "self._scale = torch.tensor([initial_scale], dtype=torch.float, device='cuda')",
                 "self._scale = torch.full([1], initial_scale, dtype=torch.float, device='cuda')")

    new_sdist, digest = _variant_sdist(sdist_of(CURRENT), tmp_path, "0.99.2", conflict)
    out = tmp_path / "out"
    result = fork("rebase", "--version", CURRENT, "--onto", "0.99.2", "--sdist", new_sdist, "--sha256", digest,
                  "--workdir", tmp_path / "tree", "--out", out, check_rc=1)
    failing = next(p.name for p in series_patches(CURRENT) if "grad-scaler" in p.name)
    assert f"{failing}: FAILED" in result.stdout
    assert "conflict in megatron/core/optimizer/grad_scaler.py at line" in result.stdout
    assert "am --continue" in result.stdout
    assert f"--out {out}" in result.stdout  # the hint exports where the user asked
    assert not out.exists()


def test_carry_onto_a_checkout_at_any_commit_merges_three_ways_and_reports_each_patch(tmp_path):
    """Megatron-LM main moves between releases: `carry` takes the series onto a checkout's
    commit with 3-way merges from the pinned upstream's blobs; --keep-going tries every patch
    and names what merged, what applied as is, and each conflict's patch, file and hunk."""
    patches = series_patches(CURRENT)
    tied = next(p.name for p in patches if "tied-MTP" in p.name)
    scaler = next(p.name for p in patches if "grad-scaler" in p.name)

    def context_edit(tree):
        _replace(tree / "megatron/core/models/gpt/gpt_model.py", "                bias=False,\n",
                 "                bias=False,  # a comment added upstream\n")

    def conflicting_edit(tree):
        _replace(tree / "megatron/core/optimizer/grad_scaler.py",
                 "self._scale = torch.tensor([initial_scale], dtype=torch.float, device='cuda')",
                 "self._scale = torch.full([1], initial_scale, dtype=torch.float, device='cuda')")

    checkout = edited_checkout(sdist_of(CURRENT), tmp_path, context_edit, conflicting_edit)
    # at the commit before the conflicting change the whole series carries over
    result = fork("carry", "--version", CURRENT, "--checkout", checkout, "--rev", "HEAD~1",
                  "--workdir", tmp_path / "clean", check_rc=0)
    assert all(f"{p.name}: ok" in result.stdout for p in patches), result.stdout
    assert "a comment added upstream" in (tmp_path / "clean/megatron/core/models/gpt/gpt_model.py").read_text()

    result = fork("carry", "--version", CURRENT, "--checkout", checkout, "--workdir", tmp_path / "measured",
                  "--keep-going", check_rc=1)
    assert f"{tied}: merged (3-way)" in result.stdout, result.stdout
    assert f"{scaler}: CONFLICT, skipped" in result.stdout
    assert "conflict in megatron/core/optimizer/grad_scaler.py at line" in result.stdout
    before = [p.name for p in patches[:[p.name for p in patches].index(scaler)]]
    assert all(f"{name}: applied" in result.stdout for name in before), result.stdout
    # every later patch is tried (one that builds on the skipped patch's lines may conflict too)
    assert all(f"{p.name}: " in result.stdout for p in patches), result.stdout

    # the conflict is in the runtime part (CPU), which a GPU user leaves out
    runtime = [p.name for p in patches if "\nPart: runtime\n" in p.read_text()]
    assert scaler in runtime
    result = fork("carry", "--version", CURRENT, "--checkout", checkout, "--workdir", tmp_path / "lean",
                  "--keep-going", "--without", "runtime", check_rc=0)
    assert "without the runtime part" in result.stdout and not any(name in result.stdout for name in runtime)
    assert all(f"{p.name}: " in result.stdout for p in patches if p.name not in runtime), result.stdout


def test_the_series_carries_past_what_megatron_lm_main_changed_beside_its_hooks(tmp_path):
    """Megatron-LM main (d98e8a64) changed the lines next to where the series used to hook in:
    a field beside mtp_detach_heads, an import at the head of training.py's and
    checkpointing.py's first-party imports, optimizer.step() wrapped in a tracing block, the
    lines before train()'s checkpoint branch, HybridModel's MTP-loss branch; and it rewrote
    upstream lines that hunks used to rewrite too: WrappedTorchNorm's return (a named instance
    with returns_residual), HybridModel's embedding call (pg_collection=) and the packed roll
    call (return_sum=). A checkout with those changes takes every patch but the runtime part's
    without a conflict (the series conflicted on all of them before: fields, imports and hooks
    next to upstream's lines, then the four hunks that re-indented or replaced upstream's)."""

    def mains_changes(tree):
        _replace(tree / "megatron/core/transformer/transformer_config.py",
                 '    only training the MTP heads themselves."""\n',
                 '    only training the MTP heads themselves."""\n\n'
                 '    mtp_hidden_state_mixing: bool = False\n    """A field upstream added."""\n')
        training = tree / "megatron/training/training.py"
        _replace(training, "# First-party.\n", "# First-party.\nfrom megatron.core._rank_utils import safe_get_rank\n")
        _replace(training, "    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()\n",
                 "    with nullcontext() as _span:\n"
                 "        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()\n")
        _replace(training, "                setup_fault_injection(fault_injector_config)\n"
                 "        if should_checkpoint:\n",
                 "                setup_fault_injection(fault_injector_config)\n"
                 "                _mark_step_span(skipped_iter)\n        if should_checkpoint:\n")
        _replace(tree / "megatron/training/checkpointing.py",
                 "from megatron.core import dist_checkpointing, mpu, tensor_parallel\n",
                 "from megatron.core import dist_checkpointing, mpu, tensor_parallel\n"
                 "from megatron.core._rank_utils import safe_get_rank as get_rank_safe\n")
        hybrid = tree / "megatron/core/models/hybrid/hybrid_model.py"
        _replace(hybrid, "            elif not in_inference_mode:\n", "            elif mtp_forward_ran:\n")
        _replace(hybrid, "scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,\n"
                 "                tp_group=self.pg_collection.tp,\n",
                 "scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,\n"
                 "                tp_group=self.pg_collection.tp,\n                pg_collection=self.pg_collection,\n")
        _replace(tree / "megatron/core/transformer/torch_norm.py",
                 "        return norm_cls(normalized_shape=hidden_size, eps=eps)\n",
                 "        instance = norm_cls(normalized_shape=hidden_size, eps=eps)\n"
                 "        instance.returns_residual = False\n        return instance\n")
        _replace(tree / "megatron/core/transformer/multi_token_prediction.py",
                 "        return _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group)\n",
                 "        return _roll_tensor_packed_seq(\n"
                 "            tensor, shifts, dims, packed_seq_params, cp_group, return_sum=return_sum\n        )\n")

    checkout = edited_checkout(sdist_of(CURRENT), tmp_path, mains_changes)
    result = fork("carry", "--version", CURRENT, "--checkout", checkout, "--workdir", tmp_path / "carried",
                  "--without", "runtime", "--keep-going", check_rc=0)
    kept = [p.name for p in series_patches(CURRENT) if "\nPart: runtime\n" not in p.read_text()]
    assert kept and "CONFLICT" not in result.stdout, result.stdout
    assert all(f"{name}: applied" in result.stdout or f"{name}: merged (3-way)" in result.stdout
               for name in kept), result.stdout
    carried = (tmp_path / "carried/megatron/training/training.py").read_text()
    assert "        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()\n" in carried
    assert "exact_step.end(optimizer, update_successful)" in carried
    norm = (tmp_path / "carried/megatron/core/transformer/torch_norm.py").read_text()
    assert "fork_norms.tagged_for_sequence_parallel(norm_cls, config)" in norm
    assert "instance.returns_residual = False" in norm

def test_every_subcommand_has_help():
    for command in ["prepare", "install", "build", "export", "check", "rebase", "carry"]:
        result = fork(command, "--help", check_rc=0)
        assert "usage: tools/fork " + command in result.stdout


@pytest.mark.matrix  # the setup path itself runs in every CI (tools/bootstrap on a fresh clone)
def test_install_and_build_are_no_ops_when_the_builds_match():
    assert "nothing to do" in fork("install", check_rc=0).stdout
    result = fork("build", "--all", check_rc=0)
    assert result.stdout.count("already built") == len(VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_fork_s_config_fields_have_one_home_outside_upstreams_file(version):
    """No patch adds a field among TransformerConfig's own (upstream adds to them in every
    release, so such hunks conflict on a newer upstream): the series changes only the class's
    base and its import, and every field is declared in the fork's MTPTrainingConfig."""
    target = "megatron/core/transformer/transformer_config.py"
    added = []
    for patch in series_patches(version):
        in_target = False
        for line in patch.read_text().splitlines():
            if line.startswith("diff --git "):
                in_target = line.endswith(f" b/{target}")
            elif in_target and line.startswith("+") and not line.startswith("+++"):
                added.append(line[1:])
    assert len(added) == 2, added
    assert re.fullmatch(r"from megatron\.core\.fork\.(mtp|backports)\.options import MTPTrainingConfig", added[0])
    assert added[1].startswith("class TransformerConfig(MTPTrainingConfig):"), added
