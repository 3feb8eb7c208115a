# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A series applied where pip installed its package, as patches/megatron-core-* patch megatron-core:
the serving engine's (vLLM's CPU build, `tools/fork engine`) and the RL framework's (verl,
`tools/fork framework`).

Each package is a wheel that pip installs into an environment of its own (tools/bootstrap --engine
vllm, --framework verl), not a tree this project builds, so its series is applied to the installed
files in place:

- pinned: patches/upstream.toml's section ([engine], [framework]) names the package and its version,
  and patches/PACKAGE-VERSION/ holds the series; any other installed version is refused;
- verified: every file a patch changes or deletes is checked against the wheel's RECORD (its sha256)
  and its pristine copy is kept in the environment (ENV/megatron-mtp-SECTION/pristine/), so that a
  changed series is applied to the pristine files again; a file a patch creates must not be the
  wheel's;
- ours or the wheel's: an installed file the series touches is either the wheel's or what the series
  last wrote (the stamp's sha256, absent for a file it deleted); anything else was changed by hand and
  is refused, before anything changes;
- checked: the whole series is applied (`git am`, as tools/fork check does) to a scratch tree of the
  pristine files first; only when every patch applies do the installed files change;
- all or nothing: before the first installed file changes, the stamp records the application under
  way (each file's sha256 to come); a failure part-way puts back what it changed and the stamp as it
  was, and an application cut short (killed) leaves files that the next run recognizes as its own;
- idempotent: the stamp records the series' digest and each file's sha256, and a run that finds them
  changes nothing; a file that an earlier series touched and this one does not (a patch dropped from
  `series`) goes back to the wheel's (a file it created is removed).
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

# the packages a section pins: what `tools/fork SECTION` applies, and the environment it defaults to
SECTIONS = {"engine": ".venv-vllm", "framework": ".venv-verl"}
# a patch's file header: the path before (None: created) and after (None: deleted)
FILE_HEADER = re.compile(r"^--- (?:a/(\S+)|/dev/null)\n\+\+\+ (?:b/(\S+)|/dev/null)$", re.M)
# what the environment's interpreter reports of the installed package
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
    section: str
    package: str
    version: str

    @property
    def directory(self) -> Path:
        return PATCHES_DIR / f"{self.package}-{self.version}"

    @property
    def store(self) -> str:
        """The folder in the environment's prefix that holds the pristine copies and the stamp."""
        return f"megatron-mtp-{self.section}"

    def patches(self) -> list[Path]:
        series = self.directory / "series"
        if not series.is_file():
            raise ForkError(f"no {self.section} series: {series} is missing")
        names = [line.strip() for line in series.read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        return [self.directory / name for name in names]


def pin(section: str) -> Pin:
    if section not in SECTIONS:
        raise ForkError(f"no series section {section!r}: the sections are {', '.join(SECTIONS)}")
    found = upstream_config().get(section)
    if not found:
        raise ForkError(f"patches/upstream.toml names no [{section}]")
    return Pin(section, found["package"], found["version"])


def file_hash(data: bytes) -> str:
    """A wheel RECORD's form: urlsafe base64 of the sha256, unpadded."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def state_hash(data: bytes | None) -> str | None:
    """A file's state as the stamp records it: its hash, None where it is absent."""
    return None if data is None else file_hash(data)


def installed(python: str, package: str) -> dict:
    try:
        done = subprocess.run([python, "-c", PROBE, package], capture_output=True, text=True, timeout=120)
    except OSError as error:
        raise ForkError(f"cannot run the environment's interpreter {python}: {error.strerror}") from None
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


def touched(patches: list[Path]) -> dict[str, str]:
    """{path: how the series first touches it}: "created" (no file before), else "changed" (a change or
    a deletion of a file that exists before)."""
    paths = {}
    for patch in patches:
        for before, after in FILE_HEADER.findall(patch.read_text()):
            paths.setdefault(before or after, "changed" if before else "created")
    return paths


def series_digest(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


class Environment:
    """The installed package of `pin` in `python`'s environment: its files, RECORD, store and stamp."""

    def __init__(self, python: str, wanted: Pin):
        found = installed(python, wanted.package)
        if found["version"] != wanted.version:
            raise ForkError(f"{wanted.package} {found['version']} is installed in {found['prefix']}; the "
                            f"{wanted.section} series patches/{wanted.directory.name} is for {wanted.version} "
                            f"only (pip install {wanted.package}=={wanted.version})")
        self.pin, self.prefix = wanted, found["prefix"]
        self.root, self.store = Path(found["root"]), Path(found["prefix"]) / wanted.store
        self.record = record_hashes(found["record"])
        self.stamp_path = self.store / "applied.json"
        self.stamp = json.loads(self.stamp_path.read_text()) if self.stamp_path.is_file() else {"files": {}}

    def ours(self, path: str) -> list:
        """The states of `path` that the series wrote: the last application's and one under way."""
        return [stamp["files"][path] for stamp in (self.stamp, self.stamp.get("pending") or {"files": {}})
                if path in stamp["files"]]

    def pristine(self, path: str, kind: str) -> bytes | None:
        """The wheel's own `path` (None: the wheel has none), after checking that the installed file is
        the wheel's or the series' own: anything else was changed by hand and is refused."""
        wanted, current = self.pin, read(self.root / path)
        if kind == "created" and path in self.record:
            raise ForkError(f"{path}: a patch creates it, but it is a file of the {wanted.package} "
                            f"{wanted.version} wheel (its RECORD)")
        if kind == "changed" and path not in self.record:
            raise ForkError(f"{path}: not a file of the {wanted.package} {wanted.version} wheel (its RECORD)")
        wheel = self.record.get(path)
        if state_hash(current) != wheel and state_hash(current) not in self.ours(path):
            raise ForkError(f"{self.root / path} is neither the {wanted.package} {wanted.version} wheel's nor what "
                            f"the series wrote (changed by hand?): reinstall it (pip install --force-reinstall "
                            f"--no-deps {wanted.package}=={wanted.version}), or keep your change as a patch")
        if wheel is None:
            return None
        for candidate in (current, read(self.store / "pristine" / path)):
            if candidate is not None and file_hash(candidate) == wheel:
                return candidate
        raise ForkError(f"{self.root / path} differs from the {wanted.package} {wanted.version} wheel and no "
                        f"pristine copy is kept: reinstall it (pip install --force-reinstall --no-deps "
                        f"{wanted.package}=={wanted.version})")

    def applied(self, digest: str, paths) -> bool:
        return (self.stamp.get("series") == digest and not self.stamp.get("pending")
                and set(self.stamp["files"]) == set(paths)
                and all(state_hash(read(self.root / path)) == self.stamp["files"][path] for path in paths))

    def install(self, digest: str, final: dict, pristine: dict) -> None:
        """Every path's final state (bytes, or None: absent), all or nothing (see the module)."""
        for path, data in pristine.items():  # kept before any installed file changes
            if data is not None:
                write_atomic(self.store / "pristine" / path, data)
        before = {path: read(self.root / path) for path in final}
        done = {"series": digest, "files": {path: state_hash(data) for path, data in final.items()}}
        write_atomic(self.stamp_path, json.dumps(dict(self.stamp, pending=done), indent=1).encode())
        changed = []
        try:
            for path, data in final.items():
                if data == before[path]:
                    continue
                changed.append(path)
                put(self.root / path, data)
        except BaseException:
            for path in changed:  # what it changed goes back, and so does the stamp
                put(self.root / path, before[path])
            write_atomic(self.stamp_path, json.dumps(self.stamp, indent=1).encode())
            raise
        write_atomic(self.stamp_path, json.dumps(done, indent=1).encode())


def apply(python: str, section: str, check_only: bool = False) -> tuple[bool, list[str]]:
    """Apply (or, check_only, try) `section`'s series in `python`'s environment; (ok, report lines)."""
    wanted = pin(section)
    patches = wanted.patches()
    env = Environment(python, wanted)
    paths = touched(patches)
    digest = series_digest(patches)
    title = f"{wanted.package} {wanted.version} in {env.prefix}:"
    if not check_only and env.applied(digest, paths):
        return True, [title, f"  the series ({len(patches)} patch(es), {digest}) is already applied"]
    pristine = {path: env.pristine(path, kind) for path, kind in paths.items()}
    # a file an earlier series touched and this one does not goes back to the wheel's
    dropped = [path for path in env.stamp["files"] if path not in paths]
    restored = {path: env.pristine(path, "changed" if path in env.record else "created") for path in dropped}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        for path, data in pristine.items():
            if data is not None:
                (tree / path).parent.mkdir(parents=True, exist_ok=True)
                (tree / path).write_bytes(data)
        init_pristine(tree, PRISTINE_TAG)
        report = apply_series(tree, patches)
        lines = [title] + [f"  {name}: {status}" for name, status in report]
        ok = len(report) == len(patches) and all(status == "ok" for _, status in report)
        if check_only:
            state = "is applied" if env.applied(digest, paths) else "is not applied (run without --check)"
            return ok, lines + [f"  the series {state}"]
        if not ok:
            return ok, lines
        final = {path: read(tree / path) for path in paths}
    env.install(digest, final | restored, pristine | restored)
    made = sum(data is not None and pristine[path] is None for path, data in final.items())
    gone = sum(data is None for data in final.values())
    return True, lines + [f"  applied to {len(paths)} file(s) in {env.root}"
                          + (f" ({made} created, {gone} deleted)" if made or gone else "")] + \
        ([f"  restored {len(restored)} file(s) the series no longer touches"] if restored else [])


def put(path: Path, data: bytes | None) -> None:
    """`path` with `data`, or absent."""
    if data is None:
        path.unlink(missing_ok=True)
    else:
        write_atomic(path, data)


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
