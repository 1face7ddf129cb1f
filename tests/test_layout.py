"""The package's shape: its import graph has no cycle, and no module uses another
module's underscore-private names.

Read from the source with ast, so imports inside functions (the lazy ones, which
hide a cycle from a plain `import accord`) count as much as those at the top.
An underscore means "this file only"; a name another module needs is public
within the package. Private modules (accord/_types.py, ...) may be imported:
their names are what the rule is about.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "accord"

# (importing module, imported module, name): uses of another module's private
# name that cannot be fixed yet, each with the reason. Keep it empty.
ALLOWED_PRIVATE = set()


def _modules():
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
# the optional C helpers (setup.py builds accord/transport/ring_core.c into
# accord.transport.ring_core, ...): modules of their own that import nothing of accord's
EXTENSIONS = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
              for p in PACKAGE.rglob("*.c")}


def _owner(name):
    """The accord module a dotted name lives in (accord.api.broadcast -> accord.api);
    None for a compiled helper's (a leaf: it imports nothing of accord's)."""
    while name not in MODULES and "." in name:
        if name in EXTENSIONS:
            return None
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _scan(mod, path, source=None):
    """(modules mod imports, [(module, private name, line)] it uses)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    deps, privates = set(), []
    bound = {}                       # local name -> the accord module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "accord":
                    continue
                deps.add(_owner(a.name))
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    bound[a.name.split(".")[0]] = "accord"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "accord":
                continue
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:          # a submodule
                    deps.add(f"{source}.{a.name}")
                    bound[a.asname or a.name] = f"{source}.{a.name}"
                else:
                    deps.add(_owner(source))
                    if _private(a.name):
                        privates.append((_owner(source), a.name, node.lineno))
    # module.attribute chains: api._run, accord.api._run
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            target = ".".join([bound[value.id]] + chain[::-1])
            if target in MODULES:
                privates.append((target, node.attr, node.lineno))
    deps.discard(mod)
    deps.discard(None)
    return deps, [p for p in privates if p[0] != mod]


SCANS = {mod: _scan(mod, path) for mod, path in MODULES.items()}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph():
    # `import accord.x` also runs accord/__init__.py first; that edge is Python's,
    # not one the module chose, and is not counted (`from accord import name` is)
    return {mod: deps for mod, (deps, _) in SCANS.items()}


def test_scanner_sees_lazy_and_attribute_uses():
    # the scanner itself: a cycle through a function-level import, and a private
    # name reached as module.attribute, are both found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    probe = ("def f():\n"
             "    from . import api\n"
             "    from .work import _hidden\n"
             "    import accord.plans as p\n"
             "    return api._x(), p._y\n")
    deps, privates = _scan("accord.probe", PACKAGE / "probe.py", probe)
    assert deps == {"accord.api", "accord.work", "accord.plans"}
    assert sorted(privates) == [("accord.api", "_x", 5), ("accord.plans", "_y", 5),
                                ("accord.work", "_hidden", 3)]


def test_import_graph_has_no_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles among accord's modules (lazy imports included): {cycles}"


def test_no_module_uses_another_modules_private_names():
    found = sorted((mod, target, name, line) for mod, (_, privates) in SCANS.items()
                   for target, name, line in privates
                   if (mod, target, name) not in ALLOWED_PRIVATE)
    assert not found, "\n".join(f"{mod} line {line} uses {target}.{name}"
                                for mod, target, name, line in found)
