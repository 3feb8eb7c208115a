# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The working tree (one commit per patch over pristine upstream), the series it exports to,
and the series' parts.

Every patch names its part in its DEP-3 header (`Part: NAME`, beside `Forwarded:`):

- runtime: makes upstream run here (CPU and gloo, Python 3.11, from the sdist); where CUDA is
  available nothing changes. It comes first in every series: pristine upstream plus this part
  is the baseline that comparisons with upstream use (`make_upstream_tree`), and a GPU user
  may leave it out (`tools/fork export --for-users DIR --without runtime`).
- fixes: general upstream fixes, independent of MTP (parallelism, optimizer, checkpoints).
- mtp: MTP and its losses in megatron-core (models, the MTP block, MoE router losses).
- training-loop: exact steps and per-depth metrics in megatron.training.
"""

import re
import shutil
import tempfile
from pathlib import Path

from megatron_mtp.patched_core import (
    BUILD_DIR,
    EXPORT_MARK,
    FORK_OWNED_DIR,
    REPO_ROOT,
    expected_build_version,
    series_dir,
    series_patches,
)

from . import upstream
from .errors import ForkError
from .git import git, init_pristine, is_dirty

PARTS = ("runtime", "fixes", "mtp", "training-loop")
RUNTIME_PART = "runtime"
PART_FIELD = re.compile(r"^Part: (\S+)$", re.M)

PRISTINE_TAG = "upstream"
FORK_OWNED_REL = "megatron/core/fork"
FORK_OWNED_MESSAGE = """Add the Megatron-MTP fork-owned modules

What: megatron/core/fork/, the new files that the rest of this series calls
into (device selection, SDPA core attention, and the MTP training logic).

Why: the series keeps hunks in upstream files thin; the logic lives in these
files, which the fork maintains as plain sources. Apply this patch first.

Forwarded: not-needed
"""

TRAINER_FILES = ("pretrain_gpt_mtp.py", "megatron_mtp")
TRAINER_MESSAGE = """Add pretrain_gpt_mtp.py and its package, megatron_mtp

What: Megatron-MTP's trainer, a sibling of pretrain_gpt.py on
megatron.training's pretrain() loop with exact steps and per-depth MTP
metrics, and the fork-owned package it imports (its argument checks and
defaults, the embedded default corpus, the library and serving modules).

Why: so that `torchrun pretrain_gpt_mtp.py ...` runs from the checkout this
series is applied to. Megatron-LM's own pretrain_gpt.py gets exact steps
with --exact-steps --calculate-per-token-loss instead.

Forwarded: not-needed
"""


def header(patch_text: str) -> str:
    """A patch's message (its DEP-3 header): what precedes the diffstat."""
    return patch_text.split("\n---\n", 1)[0]


def part_of(patch: Path) -> str:
    """The part a patch's header names (one `Part:` field, one of PARTS)."""
    found = PART_FIELD.findall(header(patch.read_text(errors="replace")))
    if len(found) != 1 or found[0] not in PARTS:
        raise ForkError(f"{patch.name}: its header needs one `Part:` field naming one of {', '.join(PARTS)} "
                        f"(found {found or 'none'})")
    return found[0]


def parts(version: str) -> list[tuple[Path, str]]:
    """(patch, part) in series order; the runtime part must come first."""
    labelled = [(patch, part_of(patch)) for patch in series_patches(version)]
    kinds = [part for _, part in labelled]
    runtime = kinds.count(RUNTIME_PART)
    if kinds[:runtime] != [RUNTIME_PART] * runtime:
        raise ForkError(f"the {RUNTIME_PART} part of {version} must come first in its series")
    return labelled


def check_part_names(names) -> None:
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise ForkError(f"no part named {', '.join(unknown)}: the parts are {', '.join(PARTS)}")


def runtime_patches(version: str) -> list[Path]:
    return [patch for patch, part in parts(version) if part == RUNTIME_PART]


def make_upstream_tree(version: str, destination: Path) -> Path:
    """Pristine upstream `version` (the verified sdist) plus only its runtime part and the
    fork-owned modules, in `destination`; returns the tree to put first on the path."""
    tree = Path(destination) / f"megatron-core-{version}"
    upstream.unpack(upstream.verified_sdist(version), tree)
    for patch in runtime_patches(version):
        git(tree, "apply", str(patch))
    (tree / FORK_OWNED_REL).symlink_to(FORK_OWNED_DIR)
    return tree


def default_workdir(version: str) -> Path:
    return BUILD_DIR / f"megatron-core-{version}"


def link_fork_owned(tree: Path) -> None:
    """Make the repo's fork-owned files visible inside `tree` without committing them there."""
    link = tree / FORK_OWNED_REL
    if link.is_symlink() or link.exists():
        return
    link.symlink_to(FORK_OWNED_DIR)
    exclude = tree / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a") as f:
        f.write(f"/{FORK_OWNED_REL}\n*.so\n")


def apply_series(tree: Path, patches: list[Path], three_way: bool = False) -> list[tuple[str, str]]:
    """`git am` the patches in one session (so `git am --continue` resumes after a conflict).

    Returns (name, status) for each patch tried; the last one is the failure, if any.
    """
    if not patches:
        return []
    before = int(git(tree, "rev-list", "--count", "HEAD").stdout)
    args = ["am", "--quiet", "--keep-cr"] + (["-3"] if three_way else [])
    result = git(tree, *args, *map(str, patches), check=False)
    applied = int(git(tree, "rev-list", "--count", "HEAD").stdout) - before
    report = [(patch.name, "ok") for patch in patches[:applied]]
    if result.returncode != 0:
        report.append((patches[applied].name, "FAILED\n" + describe_failure(tree, result)))
    return report


def describe_failure(tree: Path, result) -> str:
    """Name the files and hunks that did not apply, from git's own report and conflict markers."""
    lines = [line for line in (result.stdout + result.stderr).splitlines()
             if line.startswith(("error:", "CONFLICT", "Patch failed", "Applying"))]
    conflicted = git(tree, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
    for path in conflicted:
        text = (tree / path).read_text(errors="replace").splitlines()
        for number, line in enumerate(text, 1):
            if line.startswith("<<<<<<<"):
                lines.append(f"  conflict in {path} at line {number}")
    return "\n".join("  " + line.strip() for line in lines) or "  " + result.stderr.strip()


def prepare(version: str, workdir: Path | None = None, force: bool = False,
            sdist: Path | None = None, sha256: str | None = None) -> Path:
    workdir = Path(workdir or default_workdir(version))
    if workdir.exists():
        if (workdir / ".git").exists() and is_dirty(workdir) and not force:
            raise ForkError(
                f"{workdir} has uncommitted changes; commit them and run `tools/fork export`, "
                "or pass --force to discard them"
            )
        if not force and (workdir / ".git").exists() and not exported_matches(workdir, version):
            raise ForkError(
                f"{workdir} holds commits that differ from patches/{series_dir(version).name}; "
                "run `tools/fork export` to keep them, or pass --force to discard them"
            )
        shutil.rmtree(workdir)
    patches = series_patches(version)
    tarball = upstream.verified_sdist(version, sha256=sha256, sdist=sdist)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    upstream.unpack(tarball, workdir)
    init_pristine(workdir, PRISTINE_TAG)
    link_fork_owned(workdir)
    report = apply_series(workdir, patches)
    if report and report[-1][1] != "ok":
        raise ForkError(f"patch {report[-1][0]} does not apply to pristine {version}:\n{report[-1][1]}")
    return workdir


def previous_export(out_dir: Path) -> list[Path]:
    """The files an earlier export wrote to `out_dir` (its `series` file and the patches it
    lists). Anything else there was not written by this tool: refuse to write beside it."""
    if not out_dir.exists():
        return []
    series_file = out_dir / "series"
    listed = series_file.read_text().split() if series_file.is_file() else []
    ours = [series_file] + [out_dir / name for name in listed] if series_file.is_file() else []
    foreign = sorted(p.name for p in out_dir.iterdir() if p not in ours)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ForkError(
            f"{out_dir} holds files this tool did not write ({shown}); "
            "export into an empty or new directory (nothing there was changed)"
        )
    return [p for p in ours if p.exists()]


def format_series(tree: Path, out_dir: Path, base: str = PRISTINE_TAG) -> list[str]:
    """Write base..HEAD as numbered patches plus a quilt `series` file; returns the patch names.
    Only files an earlier export wrote are replaced."""
    for old in previous_export(out_dir):
        old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = git(tree, "format-patch", "--zero-commit", "--no-signature", "--no-numbered",
                "--no-color", "-o", str(out_dir), f"{base}..HEAD").stdout.split()
    names = [Path(n).name for n in names]
    (out_dir / "series").write_text("".join(n + "\n" for n in names))
    return names


def exported_matches(tree: Path, version: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        format_series(tree, Path(tmp))
        committed = series_dir(version)
        fresh = sorted(p.name for p in Path(tmp).iterdir())
        current = sorted(p.name for p in committed.iterdir()) if committed.is_dir() else []
        return fresh == current and all(
            (Path(tmp) / n).read_bytes() == (committed / n).read_bytes() for n in fresh
        )


def export(version: str, workdir: Path | None = None, out_dir: Path | None = None) -> list[str]:
    workdir = Path(workdir or default_workdir(version))
    if not (workdir / ".git").exists():
        raise ForkError(f"no working tree at {workdir}; run `tools/fork prepare` first")
    if is_dirty(workdir):
        raise ForkError(f"{workdir} has uncommitted changes; commit them (one commit per patch) first")
    return format_series(workdir, Path(out_dir or series_dir(version)))


def export_for_users(version: str, out_dir: Path, sdist: Path | None = None, without: tuple = ()) -> list[str]:
    """A self-contained series: a first patch adds the fork-owned files, then the committed
    series, less the patches of the parts in `without` (the rest moved onto what remains by
    3-way merges; a patch that needs a left-out one is named)."""
    check_part_names(without)
    labelled = parts(version)
    previous_export(out_dir)  # refuses, before any work, a directory holding files of others
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        upstream.unpack(upstream.verified_sdist(version, sdist=sdist), tree)
        init_pristine(tree, PRISTINE_TAG)
        _commit_own_files(tree, (FORK_OWNED_REL,), FORK_OWNED_MESSAGE)
        base = git(tree, "rev-parse", "HEAD").stdout.strip()
        report = apply_series(tree, [patch for patch, _ in labelled])
        if report and report[-1][1] != "ok":
            raise ForkError(f"patch {report[-1][0]} does not apply:\n{report[-1][1]}")
        if without:
            _drop_parts(tree, base, labelled, set(without))
        if (tree / "megatron" / "training").is_dir() and set(without) <= {RUNTIME_PART}:
            # The last patch: the trainer, and the mark by which its runtime check knows it runs
            # in a checkout the series was applied to (megatron.training ships from 0.17 on).
            _commit_own_files(tree, TRAINER_FILES, TRAINER_MESSAGE,
                              written={EXPORT_MARK: f"megatron-core {expected_build_version(version)}\n"})
        return format_series(tree, Path(out_dir))


def _commit_own_files(tree: Path, rels, message: str, written: dict | None = None) -> None:
    """One commit in `tree` of this checkout's files under `rels` that git tracks (their
    working-tree content: nothing untracked or ignored reaches a user's export), plus the
    files `written` {path: text}."""
    for name in git(REPO_ROOT, "ls-files", "-z", "--", *rels).stdout.split("\0"):
        if name:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, tree / name)
    for name, text in (written or {}).items():
        (tree / name).write_text(text)
    git(tree, "add", "-f", *rels, *(written or {}))
    git(tree, "commit", "-q", "--date", "2000-01-01T00:00:00+00:00", "-m", message)


def _drop_parts(tree: Path, base: str, labelled: list, dropped: set) -> None:
    """Rebuild base..HEAD from `base` with only the commits of the kept parts (cherry-picks:
    3-way merges that move each hunk past the context the dropped patches changed)."""
    commits = git(tree, "rev-list", "--reverse", f"{base}..HEAD").stdout.split()
    if len(commits) != len(labelled):
        raise ForkError(f"{len(commits)} commits for {len(labelled)} patches")
    git(tree, "checkout", "-q", "-B", "kept", base)
    for commit, (patch, part) in zip(commits, labelled, strict=True):
        if part in dropped:
            continue
        result = git(tree, "cherry-pick", "--allow-empty", commit, check=False)
        if result.returncode != 0:
            failure = describe_failure(tree, result)
            git(tree, "cherry-pick", "--abort", check=False)
            raise ForkError(f"{patch.name} ({part}) needs the left-out part(s) {', '.join(sorted(dropped))}:\n"
                            f"{failure}")
