"""The package is in layers: each folder imports only from the layers below it, and no module imports itself back
through others. Read from the source (imports inside functions too), not from sys.modules, so a lazy import that
closes a circle is caught as surely as one at the top of a file."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"

# Lowest first. A module may import from a lower layer and from its own folder; the base's files from one another.
LAYERS = [
    {"errors", "outcome", "families", "patches", "run_folder", "json_files", "compile_cache"},
    {"config"},
    {"data", "models", "planner"},
    {"checks"},
    {"run"},
    {"commands"},
    {"sft"},
    {"api", "cli"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer unit of finetune.X[.Y]: the folder X, or the base file X."""
    return module.split(".")[1]


def is_module(dotted: str) -> bool:
    path = PACKAGE.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """The finetune modules a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "finetune":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if is_module(submodule) else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("finetune.")}
    return {module for module in found if module != "finetune"}


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imported_modules(path) for path in PACKAGE.rglob("*.py")
            if "shipped" not in path.parts and module_name(path) != "finetune"}


def arrows_against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imports in graph.items():
        for target in imports:
            source_unit, target_unit = unit_of(module), unit_of(target)
            same_folder = source_unit == target_unit and "." in module.removeprefix("finetune.")
            both_base = RANK[source_unit] == RANK[target_unit] == 0
            if not (RANK[target_unit] < RANK[source_unit] or same_folder or both_base):
                wrong.append(f"{module} imports {target}")
    return sorted(wrong)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_every_module_of_the_package_is_in_a_layer():
    assert {unit_of(module) for module in import_graph()} <= set(RANK)


def test_each_layer_imports_only_from_the_layers_below_it():
    assert arrows_against_the_layers(import_graph()) == []


def test_no_module_imports_itself_back_through_others():
    assert circles(import_graph()) == []


def test_the_checks_see_an_arrow_back_up_and_a_circle():
    graph = {"finetune.config.files": {"finetune.run.trainer"}, "finetune.run.trainer": {"finetune.config.files"},
             "finetune.data.rows": {"finetune.models.tiny"}, "finetune.models.tiny": set()}
    assert arrows_against_the_layers(graph) == ["finetune.config.files imports finetune.run.trainer",
                                                "finetune.data.rows imports finetune.models.tiny"]
    assert circles(graph) == [["finetune.config.files", "finetune.run.trainer", "finetune.config.files"]]


def test_imports_inside_functions_count(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("def later():\n    from finetune.run import trainer\n    from finetune.errors import say\n")
    assert imported_modules(source) == {"finetune.run.trainer", "finetune.errors"}
