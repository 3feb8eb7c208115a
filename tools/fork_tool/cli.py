# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Command line of tools/fork. Every failure the user can act on prints one message, not a traceback."""

import argparse
import sys
from pathlib import Path

from megatron_mtp.patched_core import (
    REPO_ROOT,
    PatchedCoreError,
    carried_versions,
    current_upstream_version,
    series_patches,
)

from . import callers, check, install, installed, rebase, series
from .errors import ForkError


def cmd_prepare(args) -> int:
    tree = series.prepare(args.version, args.workdir, force=args.force, sdist=args.sdist)
    print(f"prepared {tree}: pristine megatron-core {args.version} (tag '{series.PRISTINE_TAG}') "
          f"plus one commit per patch")
    return 0


def cmd_install(args) -> int:
    print(install.install(args.version, copy=args.copy, force=args.force, python=args.python))
    return 0


def cmd_build(args) -> int:
    for version in carried_versions() if args.all else [args.version]:
        print(install.build(version, force=args.force, python=args.python))
    return 0


def cmd_export(args) -> int:
    if args.without and not args.for_users:
        raise ForkError("--without works with --for-users DIR (patches/ always holds the whole series)")
    if args.for_users:
        names = series.export_for_users(args.version, Path(args.for_users), sdist=args.sdist,
                                        without=tuple(args.without))
        left_out = f" (without the {', '.join(args.without)} part)" if args.without else ""
        print(f"wrote a self-contained series of {len(names)} patch(es) to {args.for_users}{left_out}")
        print(f"apply it in a Megatron-LM checkout at the matching tag with: git am {args.for_users}/*.patch")
        if any("pretrain_gpt_mtp" in name for name in names):
            print("its last patch adds pretrain_gpt_mtp.py and megatron_mtp: run the trainer from that checkout")
    else:
        names = series.export(args.version, args.workdir, args.out)
        print(f"exported {len(names)} patch(es)")
    return 0


def cmd_check(args) -> int:
    series.parts(args.version)  # every patch names its part
    total = len(series_patches(args.version))
    ok, lines = check.report_lines(
        f"pristine megatron-core {args.version}:", check.check_pristine(args.version, args.sdist), total
    )
    if args.checkout:
        ok_checkout, more = check.report_lines(
            f"checkout {args.checkout}:", check.check_checkout(args.version, Path(args.checkout)), total
        )
        ok, lines = ok and ok_checkout, lines + more
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_rebase(args) -> int:
    ok, lines = rebase.rebase(args.version, args.onto, sha256=args.sha256, sdist=args.sdist,
                              workdir=args.workdir, out_dir=args.out, force=args.force)
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_carry(args) -> int:
    ok, lines = rebase.carry(args.version, args.checkout, rev=args.rev, workdir=args.workdir, force=args.force,
                             keep_going=args.keep_going, without=tuple(args.without))
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_callers(args) -> int:
    print(callers.table(args.version), end="")
    errors = callers.layering_errors(args.version)
    for error in errors:
        print(f"tools/fork callers: a later part's folder is called: {error}", file=sys.stderr)
    return 1 if errors else 0


def cmd_installed(args) -> int:
    ok, lines = installed.apply(args.python, args.command, check_only=args.check)
    print("\n".join(lines))
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="tools/fork",
        description="Carry the Megatron-MTP patch series over pinned upstream megatron-core.",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--version", default=None,
                       help="upstream megatron-core version (default: `current` in patches/upstream.toml)")
        p.set_defaults(func=func)
        return p

    p = add("prepare", cmd_prepare, "Fetch and verify pristine upstream, and make a git working tree "
            "with one commit per patch (default .build/megatron-core-VERSION).")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--sdist", type=Path, help="use this sdist file instead of downloading it (still verified)")
    p.add_argument("--force", action="store_true", help="replace a working tree that has unexported work")

    p = add("install", cmd_install, "Install the patched megatron-core as VERSION+mtp.<series digest>; "
            "a no-op when that build is already installed.")
    p.add_argument("--copy", action="store_true",
                   help="install a plain copy (default: editable, fork-owned files linked to this checkout)")
    p.add_argument("--force", action="store_true", help="rebuild and reinstall even when up to date")
    p.add_argument("--python", default=sys.executable, help="interpreter of the target environment")

    p = add("build", cmd_build, "Build the patched megatron-core VERSION in .build/install/ (C++ helpers "
            "compiled in place) without installing it; the test suite imports such builds for every "
            "carried version. A no-op when that build exists.")
    p.add_argument("--all", action="store_true", help="every carried version (each series in patches/)")
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument("--python", default=sys.executable, help="interpreter that compiles the C++ helpers")

    p = add("export", cmd_export, "Write the working tree's commits back to patches/ (refresh), or a "
            "self-contained series for users with --for-users DIR.")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path, help="write the series here instead of patches/megatron-core-VERSION")
    p.add_argument("--for-users", metavar="DIR",
                   help="write a series that also adds the fork-owned files, for a Megatron-LM checkout")
    p.add_argument("--sdist", type=Path, help="with --for-users: use this sdist file (still verified)")
    p.add_argument("--without", action="append", default=[], metavar="PART", choices=series.PARTS,
                   help="with --for-users: leave out a part of the series (its patches' `Part:` field; "
                   "e.g. runtime, which only makes upstream run on CPU and Python 3.11); repeatable")

    p = add("check", cmd_check, "Apply the series to pristine upstream (and to --checkout PATH) "
            "and report per patch; exits 1 if any patch fails.")
    p.add_argument("--checkout", help="a Megatron-LM checkout at the matching tag")
    p.add_argument("--sdist", type=Path, help="use this sdist file instead of downloading it (still verified)")

    p = add("rebase", cmd_rebase, "Move the series onto another upstream version with 3-way merges, "
            "stopping at the first conflict with the patch, file and hunk.")
    p.add_argument("--onto", required=True, help="the upstream version to move to")
    p.add_argument("--sha256", help="sha256 of the target sdist, if patches/upstream.toml does not list it")
    p.add_argument("--sdist", type=Path, help="the target sdist file, instead of downloading it")
    p.add_argument("--workdir", type=Path, help="where to build the rebased tree")
    p.add_argument("--out", type=Path, help="write the rebased series here instead of patches/megatron-core-ONTO")
    p.add_argument("--force", action="store_true", help="replace an existing tree at the target")

    p = add("carry", cmd_carry, "Carry the series onto a Megatron-LM git checkout at any commit with "
            "3-way merges from the pinned upstream, stopping at the first conflict (or, with "
            "--keep-going, trying every patch and reporting each).")
    p.add_argument("--checkout", type=Path, required=True, help="a Megatron-LM git repository (bare or not)")
    p.add_argument("--rev", default="HEAD", help="the commit to carry the series onto (default HEAD)")
    p.add_argument("--workdir", type=Path, help="where to build the carried tree")
    p.add_argument("--keep-going", action="store_true",
                   help="skip a conflicting patch and try the rest (a measure, not a finished tree)")
    p.add_argument("--without", action="append", default=[], metavar="PART", choices=series.PARTS,
                   help="leave out a part of the series (e.g. runtime, for GPUs); repeatable")
    p.add_argument("--force", action="store_true", help="replace an existing tree at the target")

    add("callers", cmd_callers, "Print the table of the fork functions each patch's hunks call (docs/series.md "
        "holds it); exits 1 if a patch or a fork module calls a folder of a later part than its own.")
    for section, what in (("engine", "the serving engine's (vLLM's CPU build)"),
                          ("framework", "the RL framework's (verl)")):
        p = sub.add_parser(section, help=(text := (
            f"Apply {what} series (patches/upstream.toml's [{section}], patches/PACKAGE-VERSION/) to its installed "
            "files in PYTHON's environment, pristine files verified against the wheel first; a no-op when applied. "
            "Exits 1 if a patch fails.")), description=text)
        venv = installed.SECTIONS[section]
        p.add_argument("--python", default=str(REPO_ROOT / venv / "bin" / "python"),
                       help=f"the environment's interpreter (default: this checkout's {venv})")
        p.add_argument("--check", action="store_true",
                       help="only report whether every patch applies and whether the series is applied; change nothing")
        p.set_defaults(func=cmd_installed, version=None)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command not in installed.SECTIONS:
            args.version = args.version or current_upstream_version()
        return args.func(args)
    except (ForkError, PatchedCoreError) as error:
        print(f"tools/fork {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tools/fork {args.command}: interrupted", file=sys.stderr)
        return 130
