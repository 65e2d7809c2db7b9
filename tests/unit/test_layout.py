"""The package's floors (the table in plait/__init__.py): no module imports from a floor above
its own, lazy imports inside functions included; no import cycle; no module imports another's
`_private` names. The table is this test's data, so the docs and the check cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import plait


ROOT = Path(plait.__file__).parent


def floors() -> dict[str, int]:
    """'cli' or 'train/' -> its floor, from plait/__init__.py's table (columns: floor, modules
    two spaces apart, what they are; three spaces or more between columns)."""
    out = {}
    for line in plait.__doc__.splitlines():
        cells = re.split(r"\s{3,}", line.strip())
        if len(cells) == 3 and cells[0].isdigit():
            out.update({name: int(cells[0]) for name in cells[1].split()})
    return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def floor_of(module: str, table: dict[str, int]) -> int | None:
    rel = module.split(".")[1:] or ["__init__"]
    if rel == ["__init__"]:
        return max(table.values())  # the package's own docstring module imports nothing
    return table.get(rel[0] + "/", table.get(rel[0]))


def resolve(name: str) -> str | None:
    """The plait module an imported dotted name lives in (a module, or a name in one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) of every plait import in `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), "", node.lineno) for a in node.names if a.name.split(".")[0] == "plait"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "plait":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (resolve(base), a.name, node.lineno))
    return [(m, n, line) for m, n, line in found if m is not None and m != module]


def test_the_table_names_every_module():
    table = floors()
    assert len(set(table.values())) >= 5, table  # the table was read
    missing = [m for m in MODULES if floor_of(m, table) is None]
    assert not missing, f"modules with no floor in plait/__init__.py's table: {missing}"


def test_no_import_goes_up_a_floor():
    table = floors()
    up = [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} (floor {floor_of(m, table)}) imports {dep} "
        f"(floor {floor_of(dep, table)})"
        for m in MODULES
        for dep, _, line in imports(m)
        if floor_of(dep, table) > floor_of(m, table)
    ]
    assert not up, "imports that go up a floor:\n" + "\n".join(up)


def test_no_module_imports_another_modules_privates():
    private = [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {dep}.{name}"
        for m in MODULES
        for dep, name, line in imports(m)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, "give these a public name in their own module:\n" + "\n".join(private)


def test_no_import_cycles():
    graph = {m: {dep for dep, _, _ in imports(m)} for m in MODULES}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_two_test_files_share_a_name():
    """The test folders are not packages, so pytest imports each file by its bare name: two
    files of one name in different folders make the second an import error in a full run (while
    either folder alone passes)."""
    tests = Path(__file__).resolve().parents[1]
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_the_config_and_the_commands_load_without_torch():
    """`plait config`, `plait --help` and a config mistake in `plait train` answer without loading
    torch or transformers (seconds a process): the config names what it chooses among in
    plait.algo.names, and the command line catches plait's failures by the modules loaded."""
    import subprocess
    import sys

    probe = "import sys, plait.cli, plait.config; print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))"
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "[]", shown.stdout
    said = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "plait", "train", "--set", "train.learnng_rate=1"],
        capture_output=True,
        text=True,
    )
    assert said.returncode == 2 and "Did you mean 'learning_rate'" in said.stderr, said.stderr[-2000:]
    loaded = {line.split("|")[-1].strip() for line in said.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers" not in loaded and "plait.train.loop" not in loaded
