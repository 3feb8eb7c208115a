# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
import os

import pytest
import torch
from fork_tool.series import make_upstream_tree

from megatron_mtp.patched_core import build_tree, carried_versions, expected_build_version

# Every carried upstream version (a series in patches/), newest first. Tests that run
# megatron-core take a `build` (the version) and launch their bodies on that build.
BUILDS = carried_versions()
# tests/in_build runs in its own process per build (tests/test_in_build.py).
collect_ignore = [] if os.environ.get("MEGATRON_MTP_BUILD") else ["in_build"]


def pytest_sessionstart(session):
    """Every carried version must be built from this checkout's series; say how, once."""
    missing = [v for v in BUILDS if not (build_tree(v) / "megatron" / "core" / "fork").exists()]
    if missing:
        raise pytest.UsageError(
            f"no build of megatron-core {', '.join(expected_build_version(v) for v in missing)}: "
            "run `bash tools/bootstrap` (or `tools/fork install && tools/fork build --all`)"
        )


def pytest_addoption(parser):
    parser.addoption("--matrix", action="store_true",
                     help="also run the full matrix (tests marked `matrix`: every layout x depth x isolation x "
                          "version x dense/MoE/hybrid case; docs/tests.md); without it, the default tier")


# The default tier runs every test on the current build; on the older carried builds only these
# (test file, and the tests of it, or None for all): what their own modules and patches change
# (the 0.16.1-only fork modules under backports, its backported schedules and normalization), checked
# in the launches that cost least. Every other older-build case is in the matrix tier.
OLDER_BUILDS_BY_DEFAULT = {
    "tests/test_in_build.py": None,
    "tests/test_mtp_model.py": None,
    # 0.16.1's series refuses the draft objectives in one line
    "tests/test_draft_objectives.py": {"test_each_series_builds_or_refuses_the_draft_objectives"},
    # one rank: the 0.16.1 backports of the router losses' weights and scale
    "tests/test_moe_gradients.py": {"test_one_rank_matches_the_reference",
                                    "test_a_wrong_router_loss_denominator_is_detected"},
}


def _in_matrix_by_build(item) -> bool:
    build = getattr(item, "callspec", None) and item.callspec.params.get("build")
    if not build or build == BUILDS[0]:
        return False
    path = item.nodeid.split("::")[0]
    if path not in OLDER_BUILDS_BY_DEFAULT:
        return True
    names = OLDER_BUILDS_BY_DEFAULT[path]
    return names is not None and item.originalname not in names


@pytest.fixture(scope="session")
def matrix(request) -> bool:
    """Whether this run has the matrix tier: a module fixture that computes many cases in one launch
    computes the matrix cases only then."""
    return request.config.getoption("--matrix")


# The default tier's longest files (their serial seconds in fresh-clone CI on 2026-12-03: 70-150; verl's
# engine tests about 170-280 s on a loaded host on 2026-12-07, not yet timed alone),
# longest first: pytest-xdist (--dist loadfile, --no-loadscope-reorder in pytest.ini) hands out
# files in collection order, so the two workers start on these and finish together instead of
# one of them running a long file alone at the end (a tail of about a minute before).
LONGEST_FIRST = ("tests/test_verl_engine.py", "tests/test_data_and_logging.py", "tests/test_fork_tool.py",
                 "tests/test_trainer_faults.py", "tests/test_serving.py", "tests/test_trainer_moe.py",
                 "tests/test_trainer_exactness.py", "tests/test_normalization.py", "tests/test_architectures.py",
                 "tests/test_user_checkout.py", "tests/test_upstream_loss_contract.py")


def _cost_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_cost_rank)  # stable: each file's own order is kept
    for item in items:
        if _in_matrix_by_build(item):
            item.add_marker(pytest.mark.matrix)
    if not config.getoption("--matrix"):
        # the marker itself, not keywords: those hold every parent's name too, so a checkout in a
        # directory named "matrix" would deselect every test
        matrix = [item for item in items if item.get_closest_marker("matrix")]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if not item.get_closest_marker("matrix")]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CPU-only machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# The only skips a run may have: (test file, a part of the test id, the reason's start). Any other skip
# fails the run (a missing package or tool must not quietly turn a test off).
ALLOWED_SKIPS = (
    ("tests/test_gpu.py", "", "needs a CUDA device"),
    ("tests/test_examples.py", "", "checks the refusal on a machine without CUDA"),
    ("tests/test_hybrid_model.py", "core0.16.1", "HybridModel's MTP depths"),
    ("tests/test_mtp_layouts.py", "core0.16.1", "HybridModel's MTP depths"),
    ("tests/test_packed_delta_net.py", "core0.16.1", "HybridModel's MTP depths"),
    ("tests/test_context_parallel.py", "core0.16.1", "MTP with context parallelism is 0.19.2's series"),
    ("tests/test_moe_gradients.py", "core0.16.1", "MTP and the router losses under context parallelism are 0.19.2's"),
    ("tests/test_gated_delta_rule_packed.py", "core0.16.1", "megatron-core 0.16.1 has no ssm/gated_delta_net package"),
)
_skipped = []


def _allowed_skip(nodeid: str, reason: str) -> bool:
    return any(nodeid.startswith(path + "::") and part in nodeid and reason.startswith(start)
               for path, part, start in ALLOWED_SKIPS)


def _record_skip(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not _allowed_skip(report.nodeid, reason):
        _skipped.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _record_skip(report)


def pytest_collectreport(report):
    """A skip at import (a module-level pytest.importorskip) skips the whole file at collection: it
    never reaches pytest_runtest_logreport. (pytest-xdist's controller hears of it once from its workers.)"""
    if report.skipped:
        _record_skip(report)


def pytest_terminal_summary(terminalreporter):
    if _skipped:
        terminalreporter.section("skips outside the allow-list (tests/conftest.py ALLOWED_SKIPS)")
        for line in _skipped:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if _skipped and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module", params=BUILDS, ids=[f"core{v}" for v in BUILDS])
def build(request) -> str:
    """The upstream version whose patched build a test module runs on (each carried one)."""
    return request.param


@pytest.fixture(scope="module")
def upstream_tree(build, tmp_path_factory):
    """Pristine upstream megatron-core of `build` plus only the series' runtime part, which makes
    it run here (CPU/gloo, Python 3.11; it touches no MTP or normalization code), to launch bodies on
    (launch(..., upstream_tree=...))."""
    return make_upstream_tree(build, tmp_path_factory.mktemp(f"upstream-{build}"))


# Trainer tests' shared fixtures: a module names its corpus (CORPUS) and the flags of the one
# iteration its runs start from (INITIAL); the fixtures build each once per module.

@pytest.fixture(scope="module")
def dataset(request, tmp_path_factory):
    """The module's corpus, preprocessed with the bytes tokenizer: CORPUS = "sentences" (the
    default; short documents, several per sample) or "paragraphs"."""
    from tests.harness import corpora

    name = getattr(request.module, "CORPUS", "sentences")
    root = tmp_path_factory.mktemp("corpus")
    return corpora.preprocess(corpora.write_jsonl(root / f"{name}.jsonl", getattr(corpora, name)()), root / name)


@pytest.fixture(scope="module")
def initial_weights(dataset, request, tmp_path_factory):
    """One checkpoint every cut of the module's runs starts from: one iteration, one rank, of the
    module's INITIAL flags on its dataset."""
    from tests.harness.trainer import train

    root = tmp_path_factory.mktemp("initial")
    train(1, *request.module.INITIAL, "--data-path", str(dataset), "--train-iters", "1", "--save", str(root),
          "--save-interval", "1")
    return root
