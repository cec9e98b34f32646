"""No two modules of mha_rosetta import each other, directly or round a loop, function-local imports included.

grimp (installed with import-linter) reads every ``import`` statement of every module,
those inside functions too, so a lazy import that only hides a circle is a circle here.
The graph covers every package of the project (the packages list of pyproject.toml).
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp is not installed (it comes with import-linter)")

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"

# Circles tolerated for now, each with its issue (none today). When one is gone,
# `test_known_circles_are_still_circles` fails: delete its line here.
KNOWN_CIRCLES: list[frozenset] = []  # none: a circle added anywhere fails this test


def package_dirs() -> dict[str, str]:
    """pyproject's package-dir mapping: package name -> folder of this repository."""
    match = re.search(r"^package-dir = \{(.*?)\}", PYPROJECT.read_text(), re.M)
    assert match, f"{PYPROJECT} has no [tool.setuptools] package-dir mapping"
    return dict(re.findall(r'"([\w.]+)" = "([\w/]+)"', match.group(1)))


def project_packages() -> list[str]:
    """The project's packages just below ``mha_rosetta`` (core, backends, ...), from package-dir."""
    return sorted(name for name in package_dirs() if name.count(".") == 1)


def staged_tree(stage: Path) -> Path:
    """``mha_rosetta`` laid out under ``stage`` as a wheel installs it, by symbolic links.

    grimp reads a package from its folder on disk, and an editable install has no such
    folder (its finder maps each subpackage to a folder of the repository), so the graph is
    built from this staged copy instead: the same files, whatever the install.
    """
    root = stage / "mha_rosetta"
    root.mkdir()
    for name, folder in package_dirs().items():
        if name == "mha_rosetta":
            for file in (REPO / folder).glob("*.py"):
                (root / file.name).symlink_to(file)
        else:
            (root / name.split(".", 1)[1]).symlink_to(REPO / folder, target_is_directory=True)
    return stage


def circles(graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(graph, component: frozenset[str]) -> str:
    """One loop through the component, written a -> b -> ... -> a, with the lines of each import."""
    first = min(component)
    inside = sorted(m for m in graph.find_modules_directly_imported_by(first) if m in component)
    chain = graph.find_shortest_chain(importer=inside[0], imported=first)
    loop = [first, *chain]
    steps = []
    for importer, imported in itertools.pairwise(loop):
        lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
        steps.append(f"{importer} -> {imported} (line {', '.join(map(str, lines))})")
    return "; ".join(steps)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    stage = staged_tree(tmp_path_factory.mktemp("stage"))
    with pytest.MonkeyPatch.context() as patch:
        # grimp finds the package through the import system: the staged folder first, and the
        # already-imported mha_rosetta (the installed one) out of the way while it looks.
        patch.syspath_prepend(str(stage))
        patch.delitem(sys.modules, "mha_rosetta", raising=False)
        return grimp.build_graph("mha_rosetta", cache_dir=None)


def test_the_graph_covers_every_package(graph):
    packages = project_packages()
    assert len(packages) >= 8, packages  # core, backends, benchmarks, checks, explain, cli, models, diagnose
    for package in packages:
        assert package in graph.modules and any(m.startswith(package + ".") for m in graph.modules), package
    assert "mha_rosetta.backends.registry" in graph.modules


def test_no_import_circles(graph):
    new = [component for component in circles(graph) if component not in KNOWN_CIRCLES]
    assert not new, "import circles:\n" + "\n".join(describe(graph, component) for component in new)


def test_known_circles_are_still_circles(graph):
    gone = [sorted(circle) for circle in KNOWN_CIRCLES if circle not in circles(graph)]
    assert not gone, f"no longer a circle, remove it from KNOWN_CIRCLES: {gone}"


def test_the_search_finds_a_circle_hidden_in_a_function(tmp_path, monkeypatch):
    """A throwaway package whose only circle runs through a function-local import."""
    package = tmp_path / "circlepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circlepkg import b\n")
    (package / "b.py").write_text("def late():\n    from circlepkg import a\n")
    (package / "c.py").write_text("from circlepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = grimp.build_graph("circlepkg", cache_dir=None)
    assert circles(toy) == [frozenset({"circlepkg.a", "circlepkg.b"})]
    assert describe(toy, circles(toy)[0]) == "circlepkg.a -> circlepkg.b (line 1); circlepkg.b -> circlepkg.a (line 2)"
