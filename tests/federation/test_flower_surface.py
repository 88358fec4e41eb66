"""How much of Flower's inside FedSM depends on: a ratchet that only lets the number go down.

Issue 33 asks for Flower through its public API (``flwr.app``, ``flwr.clientapp``,
``flwr.serverapp``; ``flwr.common``'s top level is Flower's older public surface), at most ten
names from Flower's internal modules and at most one run-time replacement. Today the engine
reaches far past that (docs/federation.md, "Flower's public API: where FedSM stands"). This
test counts, from the source's syntax trees:

- every name the engine imports from a Flower module outside that public surface (inside
  functions too, and ``importlib.import_module("flwr...")``);
- every run-time replacement: an assignment to an attribute (or to ``__dict__[...]``) of an
  object reached from a name imported from another installed package (not the standard
  library), from a variable bound to one, or from a variable checked with the launcher's
  ``require_names`` (how it replaces a Flower module's names).

Each count must not exceed its recorded ceiling; when a change lowers one, the test says so
and the ceiling is lowered with it, so the progress stays. Run this file as a script to print
the census.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"

#: Flower's documented Python API (its API reference): what FedSM may import freely.
PUBLIC_FLOWER = frozenset({"flwr", "flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.common"})

#: Ceilings (counted at commit time; lower them as the code moves to the public API).
MAX_INTERNAL_NAMES = 49
MAX_REPLACEMENTS = 10


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _is_flower(module: str) -> bool:
    return module.split(".")[0] == "flwr"


def internal_imports(path: Path) -> list[Finding]:
    """Names ``path`` imports from Flower modules outside :data:`PUBLIC_FLOWER`."""
    rel = str(path.relative_to(ENGINE.parent))
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and _is_flower(node.module) \
                and node.module not in PUBLIC_FLOWER:
            found += [Finding(rel, node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [Finding(rel, node.lineno, a.name) for a in node.names
                      if _is_flower(a.name) and a.name not in PUBLIC_FLOWER]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and _is_flower(node.args[0].value) \
                and node.args[0].value not in PUBLIC_FLOWER:
            found.append(Finding(rel, node.lineno, f"{node.args[0].value} (import_module)"))
    return found


def _is_dependency(module: str) -> bool:
    """Another installed package's module (not the engine's own, not the standard library's)."""
    top = module.split(".")[0]
    return top not in ("engine", "__future__") and top not in sys.stdlib_module_names


def _scope_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of ``scope`` itself: nested functions, classes and lambdas are scopes of their own."""
    nodes, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _foreign_names(scope: ast.AST, outer: frozenset[str] = frozenset()) -> set[str]:
    """Names bound in ``scope`` to a dependency's module or object (``outer``: those of enclosing scopes)."""
    names: set[str] = set(outer)
    nodes = _scope_nodes(scope)
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if _is_dependency(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_dependency(node.module):
            names |= {a.asname or a.name for a in node.names}
    # a variable bound to one of them (``module = start_client_internal``, ``importlib.import_module(...)``)
    for node in sorted((n for n in nodes if isinstance(n, ast.Assign | ast.AnnAssign)), key=lambda n: n.lineno):
        value = node.value
        if value is None:
            continue
        root = value
        while isinstance(root, ast.Attribute):
            root = root.value
        from_import = isinstance(value, ast.Call) and "import_module" in ast.unparse(value.func)
        if from_import or (isinstance(root, ast.Name) and root.id in names):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _root_name(target: ast.expr) -> str | None:
    while isinstance(target, ast.Attribute | ast.Subscript):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def replacements(path: Path) -> list[Finding]:
    """Assignments in ``path`` to attributes of other packages' modules, classes or objects."""
    rel = str(path.relative_to(ENGINE.parent))
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_names = _foreign_names(tree)
    found = []
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    for scope in scopes:
        nodes = _scope_nodes(scope)
        params = set() if isinstance(scope, ast.Module) else {
            a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        foreign = _foreign_names(scope, frozenset(module_names - params))
        guarded = {node.args[0].id for node in nodes
                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require_names"
                   and node.args and isinstance(node.args[0], ast.Name)}
        for node in nodes:
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if not isinstance(target, ast.Attribute | ast.Subscript):
                    continue
                root = _root_name(target)
                is_dunder_dict = isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) \
                    and target.value.attr == "__dict__"
                if root in foreign or root in guarded or is_dunder_dict:
                    found.append(Finding(rel, node.lineno, ast.unparse(target)))
    return sorted(set(found), key=lambda f: (f.path, f.line, f.what))


@cache
def census() -> tuple[list[Finding], list[Finding]]:
    files = sorted(ENGINE.rglob("*.py"))
    return ([f for p in files for f in internal_imports(p)], [f for p in files for f in replacements(p)])


def test_flower_internal_imports_do_not_grow():
    imports, _ = census()
    assert len(imports) <= MAX_INTERNAL_NAMES, "new names from Flower's internal modules:\n" + "\n".join(
        map(str, imports))
    assert len(imports) == MAX_INTERNAL_NAMES, (
        f"{MAX_INTERNAL_NAMES - len(imports)} fewer internal Flower names: lower MAX_INTERNAL_NAMES to "
        f"{len(imports)} (and the table in docs/federation.md)")


def test_run_time_replacements_do_not_grow():
    _, replaced = census()
    assert len(replaced) <= MAX_REPLACEMENTS, "new run-time replacements:\n" + "\n".join(map(str, replaced))
    assert len(replaced) == MAX_REPLACEMENTS, (
        f"{MAX_REPLACEMENTS - len(replaced)} fewer replacements: lower MAX_REPLACEMENTS to {len(replaced)}")


def test_the_census_sees_each_kind_of_reach_in(tmp_path, monkeypatch):
    source = tmp_path / "engine" / "federation" / "sample.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import importlib\n"
        "from flwr.app import Message\n"
        "from flwr.supernode import start_client_internal\n"
        "from engine.errors import FedSMError\n"
        "def f(module, x):\n"
        "    from flwr.supercore.task_identity import TaskIdentity\n"
        "    TaskIdentity.task_id = 1\n"
        "    m = start_client_internal\n"
        "    m.time = None\n"
        "    module.attr = 2\n"  # a parameter: not counted unless checked with require_names
        "    x.metadata.__dict__['_message_id'] = 'a'\n"
        "    FedSMError.code = 3\n"  # our own class: not counted
        "    mod = importlib.import_module('flwr.superlink.cli.flower_superlink')\n"
        "    mod.entry = None\n"
        "    import sys\n"
        "    sys.argv = ['flower-superlink']\n"  # the standard library's: how a CLI entry gets its arguments
        "def g(module):\n"
        "    require_names(module, 'pull')\n"
        "    module.pull = None\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", tmp_path / "engine")
    assert [f.what for f in internal_imports(source)] == [
        "flwr.supernode.start_client_internal", "flwr.supercore.task_identity.TaskIdentity",
        "flwr.superlink.cli.flower_superlink (import_module)"]
    assert [f.what for f in replacements(source)] == [
        "TaskIdentity.task_id", "m.time", "x.metadata.__dict__['_message_id']", "mod.entry", "module.pull"]


if __name__ == "__main__":
    found_imports, found_replacements = census()
    print(f"{len(found_imports)} names from Flower's internal modules:")
    print("\n".join(f"  {f}" for f in found_imports))
    print(f"{len(found_replacements)} run-time replacements:")
    print("\n".join(f"  {f}" for f in found_replacements))
