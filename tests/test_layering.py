"""The shape of the house, read from the source (ast, no imports): the request contract stands on nothing of the
engine, no import runs back up between backend_lib's rooms, the OpenAI front imports no torch, and no test module
imports another."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "backend_lib"


def _module(path: Path) -> tuple[str, str]:
    """(dotted module name, the package its relative imports start from)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    name = ".".join(parts)
    return name, name.rsplit(".", 1)[0]


def imports(path: Path) -> set[str]:
    """Every module `path` imports (top-level or inside a function), as absolute dotted names; `from x import y`
    counts as x.y as well, so that importing a submodule by name is seen."""
    _, package = _module(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def room(module: str) -> str | None:
    """backend_lib.<room>[...]: the room (a top-level module or subpackage) of a backend_lib module."""
    parts = module.split(".")
    return parts[1] if parts[0] == "backend_lib" and len(parts) > 1 else None


def rooms_graph() -> dict[str, set[str]]:
    """room -> the other rooms it imports from."""
    rooms = {p.stem for p in LIB.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    graph: dict[str, set[str]] = {}
    for path in LIB.rglob("*.py"):
        src = room(_module(path)[0])
        for target in imports(path):
            dst = room(target)
            if dst in rooms and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_the_request_contract_imports_nothing_but_itself():
    contract = sorted((LIB / "contract").glob("*.py"))
    assert {p.name for p in contract} >= {"errors.py", "finish.py", "fields.py", "choices.py", "structured.py",
                                           "json_input.py"}
    for path in contract:
        for target in imports(path):
            assert room(target) in (None, "contract"), f"{path.relative_to(ROOT)} imports {target}"
            assert target.split(".")[0] not in ("torch", "numpy", "triton_python_backend_utils"), \
                f"{path.relative_to(ROOT)} imports {target}"


def test_no_import_runs_back_up_between_backend_libs_rooms():
    graph = rooms_graph()
    assert {"contract", "sampling"} <= graph["serving"] and graph["sampling"] == {"contract"}   # the walk sees them
    assert "contract" not in graph      # the contract stands on no other room
    assert find_cycle(graph) is None, "import cycle between backend_lib's rooms: " + " -> ".join(find_cycle(graph))
    cycle = find_cycle({**graph, "contract": {"serving"}})   # the check can fail: a back edge is found
    assert cycle is not None and "contract" in cycle and "serving" in cycle and cycle[0] == cycle[-1]


def test_openai_frontend_imports_no_torch():
    """The front runs in a small image of its own: importing every module of it (what the server imports)
    loads no torch."""
    modules = sorted(f"openai_frontend.{p.stem}" for p in (ROOT / "openai_frontend").glob("*.py")
                     if p.stem != "__init__")
    assert "openai_frontend.app" in modules and "openai_frontend.__main__" in modules
    code = ("import importlib, sys\n"
            f"for name in {['openai_frontend', *modules]!r}:\n"
            "    importlib.import_module(name)\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('backend_lib'))\n"
            "import backend_lib.sampling\n"
            "assert 'torch' in sys.modules   # the check can fail: the engine's side does load it\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_no_test_module_imports_another():
    """Shared test code lives in helper modules (tests/helpers.py, tests/*_helpers.py), not in test modules."""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    names = {p.stem for p in tests}
    assert len(names) > 40
    offenders = []
    for path in tests:
        for target in imports(path):
            parts = target.split(".")
            for k, part in enumerate(parts):
                if part in names and part != path.stem and (k == 0 or parts[k - 1] == "tests"):
                    offenders.append(f"{path.name} imports {target}")
    assert not offenders, offenders
