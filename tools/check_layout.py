"""Check the tree's shape: no source file over 1,000 lines, no function over
80 lines, no import cycle among ump's modules, no call cycle among the C
core's units, and only the core's bottom layer calling the driver or mapping
memory.

    python tools/check_layout.py [ROOT]

Prints one line per finding and exits 1 if there is any. tests/test_layout.py
runs it, so the limits stay true.

A C function is a definition that starts at column 0 and whose body runs from
a ``{`` to the ``}`` at column 0 that closes it (the core's style); a table
(``... = {`` to ``};``) is no function. A Python function is what ``ast``
reads, decorators included. A C unit depends on another when it calls (or
takes the address of) a function the other defines with external linkage;
a Python module depends on another when it imports it anywhere, inside a
function too: a lazy import still ties the two.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 80
SOURCE_SUFFIXES = {".py", ".c", ".h", ".sh"}
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", "site", "wheelhouse"}

_C_DEFINITION = re.compile(r"^(?:__attribute__\(\(\w+\)\)\s+)?(?!return\b)[A-Za-z_][\w \t*]*?\b([A-Za-z_]\w*)\s*\([^;]*$")
_C_ONE_LINE = re.compile(r"^(?:static\s+)?(?!return\b)[A-Za-z_][\w \t*]*?\b([A-Za-z_]\w*)\s*\([^;{}=]*\)\s*\{.*\}\s*$")
_C_IDENTIFIER = re.compile(r"\b([A-Za-z_]\w*)\s*\(|&\s*([A-Za-z_]\w*)\b|[(,]\s*([A-Za-z_]\w*)\s*[,)]")


#: The project's own folders (a checkout may hold others: virtual
#: environments, CuPy's examples for the bench, carried wheels).
PROJECT_DIRS = ("csrc", "ump", "tests", "tools", ".ci")


def source_files(root: pathlib.Path):
    paths = [p for p in root.iterdir() if p.is_file()]
    for folder in PROJECT_DIRS:
        if (root / folder).is_dir():
            paths += (root / folder).rglob("*")
    for path in sorted(paths):
        if path.suffix in SOURCE_SUFFIXES and path.is_file() and not SKIP_DIRS & set(path.relative_to(root).parts):
            yield path


def long_files(root: pathlib.Path):
    for path in source_files(root):
        n = len(path.read_text(errors="replace").splitlines())
        if n > MAX_FILE_LINES:
            yield f"{path.relative_to(root)}: {n} lines (at most {MAX_FILE_LINES})"


def c_functions(text: str):
    """(name, first line, last line) of each function defined in C source."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        one = _C_ONE_LINE.match(lines[i])
        if one:
            yield one.group(1), i + 1, i + 1
            i += 1
            continue
        m = _C_DEFINITION.match(lines[i])
        if m and not lines[i].startswith(("#", "typedef", "struct", "enum", "union")):
            # the signature may run over lines; the body opens at a "{" ending a line
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith("{") and not lines[j].rstrip().endswith(";"):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{") and "=" not in lines[j]:
                k = j + 1
                while k < len(lines) and lines[k].rstrip() != "}":
                    k += 1
                yield m.group(1), i + 1, k + 1
                i = k + 1
                continue
        i += 1


def python_functions(text: str):
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            yield node.name, first, node.end_lineno


def long_functions(root: pathlib.Path):
    for path in source_files(root):
        if path.suffix not in (".c", ".py"):
            continue
        text = path.read_text(errors="replace")
        found = c_functions(text) if path.suffix == ".c" else python_functions(text)
        for name, first, last in found:
            if last - first + 1 > MAX_FUNCTION_LINES:
                yield (f"{path.relative_to(root)}:{first}: {name} has {last - first + 1} lines "
                       f"(at most {MAX_FUNCTION_LINES})")


def _cycles(graph: dict[str, set[str]]):
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _strip_c(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def c_unit_graph(csrc: pathlib.Path) -> dict[str, set[str]]:
    """unit -> the units whose external functions it calls."""
    units = {p.name: _strip_c(p.read_text()) for p in sorted(csrc.glob("*.c"))}
    defined = {}
    for unit, text in units.items():
        for name, first, _ in c_functions(text):
            line = text.splitlines()[first - 1]
            if not line.startswith("static"):
                defined[name] = unit
    graph = {}
    for unit, text in units.items():
        used = set()
        for m in _C_IDENTIFIER.finditer(text):
            used.update(g for g in m.groups() if g)
        graph[unit] = {defined[n] for n in used if defined.get(n, unit) != unit}
    return graph


def python_import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (at any depth)."""
    root = package.parent
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                # a name imported from a package may be a submodule, or a
                # name its __init__ defines: the module it is in either way
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    # a package's face (``ump`` for ``from . import x``) is not a dependency
    # of its own modules on each other
    top = package.name
    for name in graph:
        graph[name].discard(top)
    return graph


#: Who may call the driver (its table, ump__cu) and map memory: the core's
#: bottom layer, so that no other unit has an OS layer of its own.
BOTTOM = {"ump__cu.": {"driver.c", "device.c", "provider.c", "phys.c"},
          "mmap(": {"provider.c", "phys.c"}, "munmap(": {"provider.c", "phys.c"},
          "memfd_create(": {"phys.c"}, "dlopen(": {"driver.c"}}


def bottom_layer(root: pathlib.Path):
    for path in sorted((root / "csrc").glob("*.c")):
        text = _strip_c(path.read_text())
        for call, allowed in BOTTOM.items():
            if call in text and path.name not in allowed:
                yield f"csrc/{path.name} calls {call.rstrip('(.')} (only {', '.join(sorted(allowed))} may)"


def cycles(root: pathlib.Path):
    for what, graph in (("C units", c_unit_graph(root / "csrc")),
                        ("Python modules", python_import_graph(root / "ump"))):
        for component in _cycles(graph):
            yield f"a cycle among {what}: {' <-> '.join(component)}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = pathlib.Path(argv[0] if argv else pathlib.Path(__file__).resolve().parent.parent)
    findings = [*long_files(root), *long_functions(root), *cycles(root), *bottom_layer(root)]
    for line in findings:
        print(line)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
