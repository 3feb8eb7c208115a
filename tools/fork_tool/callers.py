# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Which fork functions each patch's hunks call, and the order of the fork's folders.

Many fork modules are called only from hunks in upstream files, where neither an IDE nor a
reader of the fork finds the callers. `table` reads them from the series itself: the names a
hunk's added lines import from megatron.core.fork and the attributes they use of each module
so imported. docs/series.md holds the table it prints (tests/test_repository.py keeps the two
equal), and `layering_errors` checks the rule the folders follow: a patch calls only its own
part's folder or an earlier part's, and so does a fork module import.
"""

import ast
import re
from pathlib import Path

from megatron_mtp.patched_core import FORK_OWNED_DIR, series_patches

from . import series

# The fork's folders in the series' order (a part's patches may call folders up to their own);
# backports holds what megatron-core 0.19 does upstream, for the kept release (0.16.1).
FOLDER_RANK = {"runtime": 0, "upstream_fixes": 1, "mtp": 2, "backports": 2, "training_loop": 3}
PART_FOLDER = {"runtime": "runtime", "fixes": "upstream_fixes", "mtp": "mtp", "training-loop": "training_loop"}
PACKAGE = "megatron.core.fork"

_FROM = re.compile(r"^\s*from\s+(\.*[\w.]*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
_IMPORT_AS = re.compile(r"^\s*import\s+(megatron\.core\.fork[\w.]*)\s+as\s+(\w+)", re.M)


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[3:])  # below megatron.core.fork
    return (FORK_OWNED_DIR / rel).with_suffix(".py").is_file() or (FORK_OWNED_DIR / rel / "__init__.py").is_file()


def _absolute(module: str) -> str:
    """A hunk's `..fork.x` (relative inside megatron/core) as megatron.core.fork.x."""
    if module.startswith("."):
        return "megatron.core." + module.lstrip(".")
    return module


def _added_code(patch_text: str) -> str:
    """The lines a patch adds, comments dropped (a hunk's comments name modules, not calls)."""
    lines = []
    for line in patch_text.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            code = line[1:]
            if code.lstrip().startswith("#"):
                continue
            lines.append(code.split("  #")[0])
    return "\n".join(lines)


def _bindings(code: str) -> tuple[dict, dict]:
    """(alias -> fork module, name -> fork module.name) bound by the imports in `code`."""
    modules, names = {}, {}
    for match in _FROM.finditer(code):
        module = _absolute(match[1])
        if not module.startswith(PACKAGE):
            continue
        for item in match[2].strip("() \n").replace("\n", " ").split(","):
            if not item.strip():
                continue
            name, _, alias = (part.strip() for part in item.partition(" as "))
            alias = alias or name
            if _is_module(f"{module}.{name}"):
                modules[alias] = f"{module}.{name}"
            else:
                names[alias] = f"{module}.{name}"
    for match in _IMPORT_AS.finditer(code):
        modules[match[2]] = match[1]
    return modules, names


def calls(patch_text: str, series_modules: dict) -> list[str]:
    """The fork functions (module.attribute, below megatron.core.fork) a patch's added lines call:
    names they import, and attributes they use of a fork module imported under an alias anywhere
    in the series (a later patch may use a module an earlier one imported)."""
    code = _added_code(patch_text)
    modules, names = _bindings(code)
    found = set(names.values())
    for alias, module in {**series_modules, **modules}.items():
        for attribute in re.findall(rf"(?<![\w.]){re.escape(alias)}\.(\w+)", code):
            found.add(f"{module}.{attribute}")
    return sorted(name[len(PACKAGE) + 1:] for name in found)


def _series_calls(version: str) -> list[tuple[Path, str, list[str]]]:
    """(patch, its part, the fork functions it calls) for each patch of `version`'s series."""
    patches = [(patch, series.part_of(patch), patch.read_text()) for patch in series_patches(version)]
    aliases = {}
    for _, _, text in patches:
        aliases.update(_bindings(_added_code(text))[0])
    return [(patch, part, calls(text, aliases)) for patch, part, text in patches]


def table(version: str) -> str:
    """The Markdown table of `version`'s series: patch, part, the fork functions it calls."""
    rows = [f"| Patch ({version}) | Part | Fork functions its hunks call |", "| --- | --- | --- |"]
    for patch, part, called in _series_calls(version):
        cell = ", ".join(f"`{name}`" for name in called) or "none"
        rows.append(f"| {patch.stem[:4]} {patch.stem[5:].replace('-', ' ')} | {part} | {cell} |")
    return "\n".join(rows) + "\n"


def _folder(dotted_below_fork: str) -> str:
    return dotted_below_fork.split(".")[0]


def layering_errors(version: str) -> list[str]:
    """Each patch that calls a fork folder of a later part than its own, and each fork module
    that imports from a folder of a later part than its own."""
    errors = []
    for patch, part, called in _series_calls(version):
        for name in called:
            folder = _folder(name)
            if FOLDER_RANK.get(folder, 99) > FOLDER_RANK[PART_FOLDER[part]]:
                errors.append(f"{patch.name} (part {part}) calls {name}")
    for path in sorted(FORK_OWNED_DIR.rglob("*.py")):
        rel = path.relative_to(FORK_OWNED_DIR)
        if len(rel.parts) < 2:
            continue  # the package's own __init__
        own = FOLDER_RANK.get(rel.parts[0], 99)
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                targets = [node.module] if node.module != PACKAGE else [f"{PACKAGE}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(PACKAGE + ".")]
            for target in targets:
                folder = _folder(target[len(PACKAGE) + 1:])
                if FOLDER_RANK.get(folder, 99) > own:
                    errors.append(f"megatron/core/fork/{rel} ({rel.parts[0]}) imports {target}")
    return errors
