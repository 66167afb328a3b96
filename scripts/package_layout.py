"""The shape of a package: its modules, its largest module and its deepest import chain.

    python scripts/package_layout.py diloco/protocol [--rev COMMIT]

Reads the sources (at ``COMMIT`` through ``git show`` when given, else the work tree) and
parses every ``import``/``from ... import`` naming a module of the package, at any depth
in the file. A chain is a path in that import graph (the package's ``__init__`` maps
left out: they import nothing of their own); its length counts modules.
"""

from __future__ import annotations

import argparse
import ast
import functools
import subprocess
from pathlib import Path


def sources(package: str, rev: str | None) -> dict[str, str]:
    """Dotted module name -> source, for every module of ``package`` (a path)."""
    if rev is None:
        files = {str(p): p.read_text() for p in Path(package).rglob("*.py")}
    else:
        listing = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, package],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        files = {
            name: subprocess.run(
                ["git", "show", f"{rev}:{name}"], capture_output=True, text=True, check=True
            ).stdout
            for name in listing
            if name.endswith(".py")
        }
    return {name[: -len(".py")].replace("/", "."): text for name, text in files.items()}


def imports(module: str, text: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(n for n in names if n in known and n != module)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package", help="a package folder, e.g. diloco/protocol")
    parser.add_argument("--rev", help="a git commit (default: the work tree)")
    args = parser.parse_args()
    modules = {
        name: text
        for name, text in sources(args.package.rstrip("/"), args.rev).items()
        if not name.endswith("__init__")
    }
    known = set(modules)
    graph = {m: imports(m, text, known) for m, text in modules.items()}

    @functools.cache
    def chain(module: str) -> tuple[str, ...]:
        below = [chain(m) for m in sorted(graph[module])]
        return (module, *max(below, key=len, default=()))

    lines = {m: len(text.splitlines()) for m, text in modules.items()}
    largest = max(lines, key=lines.__getitem__)
    deepest = max((chain(m) for m in sorted(modules)), key=len)
    root = args.package.rstrip("/").replace("/", ".")
    folders: dict[str, int] = {}
    for m in modules:
        folder = m[len(root) + 1 :].rpartition(".")[0] or "."
        folders[folder] = folders.get(folder, 0) + 1
    print(f"modules: {len(modules)} (without the __init__ maps)")
    print("per folder: " + ", ".join(f"{f} {n}" for f, n in sorted(folders.items())))
    print(f"largest: {largest} ({lines[largest]} lines)")
    print(f"deepest import chain: {len(deepest)} modules: {' -> '.join(deepest)}")


if __name__ == "__main__":
    main()
