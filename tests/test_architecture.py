"""The floor plan holds: one folder per part, the dependency rules of docs/architecture.md §3
cover every part, no import circle anywhere (imports under TYPE_CHECKING and inside functions
included), and the module paths that moved are gone."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
import tomllib
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("kvstore", "replay", "policies")
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "cli.py", "codecs.py", "errors.py", "layout.py", "py.typed"}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOTS, include_external_packages=False)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of two or more modules (iterative Tarjan)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in adj:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            if i < len(adj[v]):
                work.append((v, i + 1))
                w = adj[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def test_no_module_imports_itself_round_a_circle(graph: grimp.ImportGraph) -> None:
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    g = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        g.add_module(m)
    g.add_import(importer="a.x", imported="a.y")
    g.add_import(importer="a.y", imported="a.x")
    g.add_import(importer="a.z", imported="a.x")
    assert _cycles(g) == [["a.x", "a.y"]]


def test_the_top_of_kvstore_holds_only_the_entry_points_and_the_shared_vocabulary() -> None:
    files = {p.name for p in (REPO / "kvstore").iterdir() if p.is_file()}
    assert files <= TOP_LEVEL_MODULES, f"modules belong in a part's folder: {sorted(files - TOP_LEVEL_MODULES)}"


def test_every_part_is_placed_in_the_layers_contract() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}
    parts = {f"kvstore.{p.name}" for p in (REPO / "kvstore").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {f"kvstore.{p.stem}" for p in (REPO / "kvstore").glob("*.py") if p.stem != "__init__"}
    parts |= {"replay", "policies"}
    assert parts - placed == set(), "a part outside the layers escapes the dependency rules"


@pytest.mark.parametrize("old", [
    "kvstore.store_types", "kvstore.store_placement", "kvstore.store_sessions", "kvstore.pins", "kvstore.key_chain",
    "kvstore.key_memo", "kvstore.client_types", "kvstore.client_wire", "kvstore.client_async", "kvstore.metrics",
    "kvstore.ledger", "kvstore.explain", "kvstore.trace", "kvstore.tune", "kvstore.request_bills", "kvstore.quantize",
    "kvstore.demo", "kvstore.admin", "kvstore.service.wire", "kvstore.service.framing", "kvstore.service.runners",
    "kvstore.service.replay_port", "kvstore.service.bills", "policies.factory", "replay.model", "replay.quality",
])
def test_old_module_paths_are_gone(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_client_keeps_its_public_names() -> None:
    import kvstore.client as client

    for name in ("KvstoreClient", "AsyncKvstoreClient", "LookupResult", "ResumeResult", "Bills", "RpcFailure"):
        assert hasattr(client, name), name


def test_the_code_cites_only_documents_in_the_repository() -> None:
    cited = []
    for root in (*ROOTS, "tests", "scripts", "proto"):
        for p in [*(REPO / root).rglob("*.py"), *(REPO / root).rglob("*.proto")]:
            if "DESIGN" ".md" in p.read_text():  # spelt apart, so this file does not cite it
                cited.append(str(p.relative_to(REPO)))
    assert cited == [], "the design is docs/architecture.md"


def test_every_section_the_code_cites_exists_in_the_design() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    headings = set(re.findall(r"^#+ (\d+(?:\.\d+)*)\.? ", doc, re.M))
    cited = set()
    for root in (*ROOTS, "tests"):
        for p in (REPO / root).rglob("*.py"):
            cited |= set(re.findall(r"docs/architecture\.md §(\d+(?:\.\d+)*)", p.read_text()))
    assert cited and cited <= headings, sorted(cited - headings)


def _only_raises_not_implemented(f: object) -> bool:
    """A declaration of a method another part of the store implements (its body, past a
    docstring, is `raise NotImplementedError`)."""
    if not inspect.isfunction(f):
        return False
    body = ast.parse(textwrap.dedent(inspect.getsource(f))).body[0].body  # type: ignore[attr-defined]
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc))


def test_the_store_facade_resolves_every_name_to_an_implementation() -> None:
    # GlobalStore is composed of parts that declare what they call of each other; the order of its
    # bases decides which definition a name takes, and a declaration winning would fail only at run time.
    from kvstore.store.global_store import GlobalStore

    declared = {name for part in GlobalStore.__mro__ for name, f in vars(part).items()
                if _only_raises_not_implemented(f)}
    assert declared, "the parts declare what they call of each other"
    winners = {name: inspect.getattr_static(GlobalStore, name) for name in declared}
    assert [n for n, f in winners.items() if _only_raises_not_implemented(f)] == []
