# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The serving engine's series: vLLM's CPU build patched where it is installed, as patches/megatron-core-*
patch megatron-core.

The engine is a wheel that pip installs into an environment of its own (tools/bootstrap --engine vllm),
not a tree this project builds, so its series is applied to the installed files in place:

- pinned: patches/upstream.toml's [engine] names the package and its version, and
  patches/PACKAGE-VERSION/ holds the series; any other installed version is refused;
- verified: every file a patch touches is checked against the wheel's RECORD (its sha256) before it
  is patched, and its pristine copy is kept in the environment (ENV/megatron-mtp-engine/pristine/),
  so that a changed series is applied to the pristine files again;
- checked: the whole series is applied (`git am`, as tools/fork check does) to a scratch tree of the
  pristine files first; only when every patch applies are the patched files moved into place;
- idempotent: a stamp records the series' digest and each patched file's sha256, and a run that
  finds them changes nothing; a file that an earlier series patched and this one does not (a patch
  dropped from `series`) goes back to the wheel's.
"""

import base64
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_mtp.patched_core import PATCHES_DIR, upstream_config

from .errors import ForkError
from .git import init_pristine
from .series import PRISTINE_TAG, apply_series

STORE = "megatron-mtp-engine"  # in the engine environment's prefix: pristine copies and the stamp
TOUCHED = re.compile(r"^--- a/(\S+)$", re.M)
# what the engine's interpreter reports of the installed package
PROBE = """import importlib.metadata as m, json, sys
try:
    d = m.distribution(sys.argv[1])
except m.PackageNotFoundError:
    print("null")
else:
    print(json.dumps({"version": d.version, "root": str(d.locate_file("")), "prefix": sys.prefix,
                      "record": d.read_text("RECORD") or ""}))
"""


@dataclass(frozen=True)
class Pin:
    package: str
    version: str

    @property
    def directory(self) -> Path:
        return PATCHES_DIR / f"{self.package}-{self.version}"

    def patches(self) -> list[Path]:
        series = self.directory / "series"
        if not series.is_file():
            raise ForkError(f"no engine series: {series} is missing")
        names = [line.strip() for line in series.read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        return [self.directory / name for name in names]


def pin() -> Pin:
    engine = upstream_config().get("engine")
    if not engine:
        raise ForkError("patches/upstream.toml names no [engine]")
    return Pin(engine["package"], engine["version"])


def file_hash(data: bytes) -> str:
    """A wheel RECORD's form: urlsafe base64 of the sha256, unpadded."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def installed(python: str, package: str) -> dict:
    try:
        done = subprocess.run([python, "-c", PROBE, package], capture_output=True, text=True, timeout=120)
    except OSError as error:
        raise ForkError(f"cannot run the engine's interpreter {python}: {error.strerror}") from None
    if done.returncode:
        raise ForkError(f"{python} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    found = json.loads(done.stdout)
    if found is None:
        raise ForkError(f"{package} is not installed in {python}'s environment")
    return found


def record_hashes(record: str) -> dict[str, str]:
    hashes = {}
    for line in record.splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            hashes[path] = digest[len("sha256="):]
    return hashes


def series_digest(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def apply(python: str, check_only: bool = False) -> tuple[bool, list[str]]:
    """Apply (or, check_only, try) the engine series in `python`'s environment; (ok, report lines)."""
    wanted = pin()
    patches = wanted.patches()
    found = installed(python, wanted.package)
    if found["version"] != wanted.version:
        raise ForkError(f"{wanted.package} {found['version']} is installed in {found['prefix']}; the engine series "
                        f"patches/{wanted.directory.name} is for {wanted.version} only "
                        f"(pip install {wanted.package}=={wanted.version})")
    root, store = Path(found["root"]), Path(found["prefix"]) / STORE
    record = record_hashes(found["record"])
    paths = sorted({path for patch in patches for path in TOUCHED.findall(patch.read_text())})
    digest = series_digest(patches)
    stamp = store / "applied.json"
    title = f"{wanted.package} {wanted.version} in {found['prefix']}:"
    applied = json.loads(stamp.read_text()) if stamp.is_file() else {"files": {}}
    if not check_only and applied.get("series") == digest and all(
            (root / path).is_file() and file_hash((root / path).read_bytes()) == applied["files"].get(path)
            for path in paths):
        return True, [title, f"  the series ({len(patches)} patch(es), {digest}) is already applied"]
    pristine = {path: pristine_bytes(path, root, store, record, wanted) for path in paths}
    # a file an earlier series patched and this one does not goes back to the wheel's
    restored = {path: pristine_bytes(path, root, store, record, wanted) for path in applied["files"]
                if path not in pristine}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        for path, data in pristine.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(data)
        init_pristine(tree, PRISTINE_TAG)
        report = apply_series(tree, patches)
        lines = [title] + [f"  {name}: {status}" for name, status in report]
        ok = len(report) == len(patches) and all(status == "ok" for _, status in report)
        if not ok or check_only:
            return ok, lines
        patched = {path: (tree / path).read_bytes() for path in paths}
    for path, data in pristine.items():  # kept before any installed file changes
        write_atomic(store / "pristine" / path, data)
    for path, data in (patched | restored).items():
        write_atomic(root / path, data)
    write_atomic(stamp, json.dumps({"series": digest, "files": {path: file_hash(data)
                                                                 for path, data in patched.items()}},
                                   indent=1).encode())
    return True, lines + [f"  applied to {len(paths)} file(s) in {root}"] + \
        ([f"  restored {len(restored)} file(s) the series no longer patches"] if restored else [])


def pristine_bytes(path: str, root: Path, store: Path, record: dict, wanted: Pin) -> bytes:
    """The wheel's own `path`: the installed file, or the copy kept when it was patched, each verified."""
    if path not in record:
        raise ForkError(f"{path}: not a file of the {wanted.package} {wanted.version} wheel (its RECORD)")
    for candidate in (root / path, store / "pristine" / path):
        if candidate.is_file() and file_hash(data := candidate.read_bytes()) == record[path]:
            return data
    raise ForkError(f"{root / path} differs from the {wanted.package} {wanted.version} wheel and no pristine copy "
                    f"is kept: reinstall it (pip install --force-reinstall --no-deps "
                    f"{wanted.package}=={wanted.version})")


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else None
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
        handle.write(data)
    if mode is not None:
        os.chmod(handle.name, mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)
    os.replace(handle.name, path)
