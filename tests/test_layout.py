"""The dependency direction, read from the source (every import, lazy ones inside functions included).

models (leaf) <- trainers <- qbench; inside qbench: quant <- eval <- studies <- cli. And no two modules import
each other, directly or around a longer circle (a circle makes the import order matter and hides a layer).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "trainers", "qbench")
# importer prefix -> prefixes it must never import
FORBIDDEN = {
    "models": ("trainers", "qbench"),
    "trainers": ("qbench",),
    "qbench.quant": ("qbench.eval", "qbench.studies", "qbench.cli"),
    "qbench.eval": ("qbench.studies", "qbench.cli"),
    "qbench.studies": ("qbench.cli",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file, each resolved to the module it names."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "import a.b.c" of a non-module attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_module_imports_upwards():
    wrong = [
        f"{importer} imports {target}"
        for importer, targets in graph().items()
        for prefix, banned in FORBIDDEN.items()
        if _within(importer, prefix)
        for target in sorted(targets)
        if any(_within(target, b) for b in banned)
    ]
    assert not wrong, "imports against the layer direction:\n" + "\n".join(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_circle_and_ignores_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_resolver_sees_lazy_and_relative_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from qbench.studies import plots\n    import qbench.eval.harness\n")
    known = {"qbench", "qbench.studies", "qbench.studies.plots", "qbench.eval", "qbench.eval.harness"}
    assert imports_of("qbench.x", path, known) == {"qbench.studies.plots", "qbench.eval.harness"}


# Circles that arrived this session in other people's work, each with what would dissolve it. A circle not listed
# fails; a listed one that is gone fails too (so the allowance is removed with the circle).
KNOWN_CIRCLES: set[tuple[str, str]] = set()  # circles tolerated for now (none)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package):
    edges = {name: targets for name, targets in graph().items() if _within(name, package)}
    # a package's __init__ importing its own submodules (re-exports) is not a circle between layers
    edges = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in edges.items()}
    found = {tuple(c) for c in cycles(edges)}
    known = {c for c in KNOWN_CIRCLES if c[0].split(".")[0] == package}
    assert found - known == set(), "import circles (a module reaches itself through its imports)"
    assert known - found == set(), "a known circle is gone: remove it from KNOWN_CIRCLES"


KERNELS = ROOT / "qbench" / "quant" / "kernels"
NATIVE_EXTS = ("*.c", "*.h", "*.cc", "*.cpp", "*.cu", "*.cuh")  # compiled kernel code of any kind


def test_kernel_code_lives_in_one_tree():
    """Every compiled or GPU kernel is in qbench/quant/kernels/: C sources, ctypes bindings, Triton kernels and
    the one build helper — nowhere else in the packages."""
    c_files = [p for pkg in (*PACKAGES, "scripts") for ext in NATIVE_EXTS for p in (ROOT / pkg).rglob(ext)]
    assert c_files and all(p.parent == KERNELS for p in c_files), c_files
    outside = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.is_relative_to(KERNELS):
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n.split(".")[0] in ("ctypes", "triton") for n in names):
                    outside.append(f"{path.relative_to(ROOT)} imports {names}")
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("CDLL", "load_inline"):
                    outside.append(f"{path.relative_to(ROOT)} loads or builds a shared library")
    assert not outside, outside


def test_kernel_sources_are_package_data_and_one_function_per_isa():
    """Every C file and header of the kernels is shipped (pyproject's package-data globs) and built (the
    library's source list or its own loader); the ISA is chosen in one place: only native.c's dispatch table and
    native_avx2.c's file guard test for AVX2, never a function body, and the reference holds no intrinsics."""
    import fnmatch

    import tomllib

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "qbench"
    ]
    for path in (p for ext in NATIVE_EXTS for p in KERNELS.glob(ext)):
        rel = path.relative_to(ROOT / "qbench").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data: {globs}"
    from qbench.quant.kernels import native

    built = {*native.NATIVE_SOURCES, "fake_quant.c"}
    assert {p.name for p in KERNELS.glob("*.c")} == built
    isa_tests = {
        p.name: [line for line in p.read_text().splitlines() if line.startswith("#if") and "AVX" in line]
        for p in KERNELS.glob("native*.[ch]")
    }
    assert isa_tests == {
        "native.h": [  # the macros; prototypes
            "#if defined(__AVX2__) && defined(__FMA__)",
            "#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)",
            "#ifdef QK_AVX2",
            "#ifdef QK_AVX512VNNI",
        ],
        "native.c": ["#if defined(QK_AVX2)", "#if defined(QK_AVX512VNNI)"],  # the dispatch table
        "native_avx2.c": ["#ifdef QK_AVX2"],  # the whole file
        "native_avx512.c": ["#ifdef QK_AVX512VNNI"],  # the whole file
        "native_ref.c": [],
        "native_decode.c": [],  # plain C that every target vectorises its own way
    }, isa_tests
    assert "_mm" not in (KERNELS / "native_ref.c").read_text()
    assert "_mm" not in (KERNELS / "native_decode.c").read_text()


def test_docs_layout_lists_every_module():
    """docs/layout.md is where a newcomer finds what each file is for: a module missing there is one nobody finds."""
    root = Path(__file__).resolve().parents[1]
    layout = (root / "docs" / "layout.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", layout, flags=re.M))
    sources = {
        str(p.relative_to(root))
        for top in ("models", "trainers", "qbench")
        for p in (root / top).rglob("*")
        if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts
    }
    assert sources - listed == set(), f"modules missing from docs/layout.md: {sorted(sources - listed)}"


# The card package reads one way (qbench/studies/card/__init__.py): the renderers read card.json alone, and the
# modules that decide or speak stay small enough to read in one sitting.
CARD = "qbench.studies.card"
CARD_MAX_LINES = 550  # schema.py, declarations only, is the largest
RENDER_NEVER = ("measure", "build", "decide", "compare", "words", "rows", "repair", "profile", "config")


def _card_modules() -> dict[str, Path]:
    return {n: p for n, p in modules().items() if _within(n, CARD)}


def test_the_card_renderers_read_card_json_alone():
    g = graph()
    wrong = [
        f"{m} imports {t}"
        for m in _card_modules()
        if _within(m, f"{CARD}.render")
        for t in sorted(g[m])
        if any(_within(t, f"{CARD}.{banned}") for banned in RENDER_NEVER)
    ]
    assert not wrong, "a renderer that decides or measures:\n" + "\n".join(wrong)


def test_the_card_package_has_no_long_files_and_at_most_one_long_function():
    long_files = {
        str(p.relative_to(ROOT)): n
        for p in _card_modules().values()
        if (n := len(p.read_text().splitlines())) > CARD_MAX_LINES
    }
    assert not long_files, f"card modules over {CARD_MAX_LINES} lines: {long_files}"
    long_functions = [
        f"{p.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p in _card_modules().values()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert len(long_functions) <= 1, f"more than one card function over 80 lines: {long_functions}"


@pytest.mark.parametrize(
    ("module", "why"),
    [
        ("qbench.studies.card", "qbench card --help reads the budgets"),
        ("qbench.studies.card.words", "the card's sentences are text from decisions"),
    ],
)
def test_these_card_modules_import_no_torch(module, why):
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch, yet {why}"
