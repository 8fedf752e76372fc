"""The shape of the code, checked from the source alone (`ast`, nothing imported): small modules,
no import cycles, no private names reached across modules, a core that never imports the zoo,
and a short public API."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_kvtrans"
CLI = ROOT / "cli"  # installs as mlx_kvtrans.cli
MAX_LINES = 500
MAX_PUBLIC_NAMES = 20


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of mlx_kvtrans/ and cli/."""
    found = {}
    for base, name in ((PACKAGE, "mlx_kvtrans"), (CLI, "mlx_kvtrans.cli")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


MODULES = _modules()


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _all_imports(tree: ast.Module):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _targets(module: str, node) -> list[tuple[str, str | None]]:
    """(project module imported, name taken from it or None) for one import statement."""
    out = []
    if isinstance(node, ast.Import):
        out = [(alias.name, None) for alias in node.names]
    else:
        source = _absolute(module, node)
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            out.append((sub, None) if sub in MODULES else (source, alias.name))
    return [(m, name) for m, name in out if m in MODULES]


def _trees():
    return {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}


TREES = _trees()


def _imports_that_run(tree: ast.Module):
    """Every import statement that can run, at module level or inside a function: all but
    those under `if TYPE_CHECKING:`."""
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for part in node.body for n in ast.walk(part)}
    return (n for n in _all_imports(tree) if id(n) not in typing_only)


def _graph(imports=_imports_that_run) -> dict[str, set[str]]:
    return {m: {target for node in imports(tree) for target, _ in _targets(m, node)
                if target != m}
            for m, tree in TREES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_import_cycles():
    assert not _cycles(_graph())


def test_no_import_cycles_even_for_type_checking():
    """Not even a type annotation reaches back: a switch reads its session through values
    (`switching.Conversation`), reading and decoding through the line (`line.Recording`)."""
    assert not _cycles(_graph(imports=_all_imports))


# the package's layers, lowest first: a module imports its own layer and those below it only
LAYERS = (
    ("backend", "errors", "_version", "files"),
    ("layouts", "models", "tokens"),
    ("capture",),
    ("translators",),  # what a switch runs
    ("session", "prompt_cache"),
    ("chat", "serve", "evaluation", "tools"),  # what users run, over the runtime
    ("training",),  # what a fit runs, over the runtime it fits for
    ("timing", "zoo", "cli", ""),  # "": the public API in mlx_kvtrans/__init__.py
)


def _layer(module: str) -> int:
    top = module.removeprefix("mlx_kvtrans").lstrip(".").split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_imports_point_down_the_layers_only():
    """layouts < capture < translators < session < chat, serve; training above the runtime."""
    upward = sorted(f"{m} -> {t}" for m, targets in _graph(imports=_all_imports).items()
                    for t in targets if _layer(t) > _layer(m))
    assert not upward, upward


def test_no_line_assigns_three_names_from_a_tuple_of_expressions():
    """`a, b, c = x, y, z` packs three statements into one line: one assignment a line."""
    packed = [f"{m}:{node.lineno}" for m, tree in TREES.items() for node in ast.walk(tree)
              if isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple)
              and len(node.targets[0].elts) >= 3]
    assert not packed, packed


def test_the_package_root_holds_at_most_eight_modules():
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 8, root


def test_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_imported_across_modules():
    found = []
    for m, tree in TREES.items():
        for node in _all_imports(tree):
            for target, name in _targets(m, node):
                if name and name.startswith("_") and not name.startswith("__"):
                    found.append(f"{m}: from {target} import {name}")
        # module._name where `module` is bound to another project module
        bound = {}
        for node in _all_imports(tree):
            for alias in node.names:
                if isinstance(node, ast.Import):
                    if alias.asname and alias.name in MODULES:
                        bound[alias.asname] = alias.name
                else:
                    sub = f"{_absolute(m, node)}.{alias.name}"
                    if sub in MODULES:
                        bound[alias.asname or alias.name] = sub
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{m}: {bound[node.value.id]}.{node.attr}")
    assert not found, found


def test_core_never_imports_the_zoo():
    found = [f"{m} imports {target}" for m, tree in TREES.items()
             if not (m.startswith("mlx_kvtrans.zoo") or m.startswith("mlx_kvtrans.cli"))
             for node in _all_imports(tree) for target, _ in _targets(m, node)
             if target == "mlx_kvtrans.zoo" or target.startswith("mlx_kvtrans.zoo.")]
    assert not found, found


def test_public_api_is_short():
    names = None
    for node in TREES["mlx_kvtrans"].body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = ast.literal_eval(node.value)
    assert names is not None, "mlx_kvtrans/__init__.py defines no __all__"
    assert len(names) <= MAX_PUBLIC_NAMES, f"{len(names)} names: {names}"
    assert len(set(names)) == len(names)


def test_every_subpackage_is_installed():
    """pyproject.toml lists every package of mlx_kvtrans/ (a non-editable install needs each)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, sorted(packages - listed)


def test_every_weights_folder_python_could_import_is_listed():
    """setuptools warns at install about every folder of weights/ whose name Python could import
    (a namespace package) unless it is listed; the set-up prints no warning."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folders = {"mlx_kvtrans.weights." + p.name for p in (ROOT / "weights").iterdir()
               if p.is_dir() and p.name.isidentifier() and any(p.iterdir())}
    assert folders <= listed, sorted(folders - listed)


def _functions():
    """(module file, function node) for every function of the package and the CLI."""
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_no_function_over_80_lines():
    """A function a reader holds in mind at once; a CLI function parses, calls the library and
    prints."""
    long = {f"{path.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > 80}
    assert not long, f"functions over 80 lines: {long}"


# where many parameters are the point: a drop-in for mlx-lm's function of the same arguments,
# and the public constructor and stage-2 call whose keywords are the API (`Session` holds its
# options as one `switching.Settings`)
MANY_PARAMETERS = {"gated_delta_update_chunked", "Session.__init__", "distill"}
MAX_PARAMETERS = 10


def test_functions_of_many_options_take_a_config_object():
    """Past a few options a function takes a config (a frozen dataclass), as `FitConfig`,
    `DistillConfig`, `CalibrationConfig`, `FrontierConfig` do; the CLI's commands, whose
    parameters are their options, are apart."""
    many = {}
    for path, node in _functions():
        if path.is_relative_to(CLI):
            continue
        args = node.args
        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        count = len(names) - (names[:1] in (["self"], ["cls"]))
        name = node.name if node.name != "__init__" else f"{_class_of(path, node)}.__init__"
        if count > MAX_PARAMETERS and name not in MANY_PARAMETERS:
            many[f"{path.relative_to(ROOT)}:{name}"] = count
    assert not many, f"functions of over {MAX_PARAMETERS} parameters: {many}"


def _class_of(path: Path, function: ast.FunctionDef) -> str:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any(
                isinstance(n, ast.FunctionDef) and n.lineno == function.lineno
                for n in node.body):
            return node.name
    return "?"
