"""No import cycles (issue 40): the package and the benches are a graph that runs one way. The graph is
read from the source (every `import` and `from ... import`, at module level or deferred inside a function,
so a cycle hidden behind a late import counts too); a cycle fails naming its files."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_graph(folders=("dflash_train", "bench")) -> dict[str, set[str]]:
    files = [p for d in folders for p in (REPO / d).rglob("*.py")]
    module_of = {p: ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in files}
    modules = set(module_of.values())
    graph = {m: set() for m in modules}
    for path, module in module_of.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from pkg import module` names a module, else a name in one
                    named = f"{node.module}.{alias.name}"
                    graph[module].add(named if named in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names)
    return {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child), on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_cycles_finds_a_loop_of_three_and_nothing_in_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_package_and_the_benches_import_without_cycles():
    graph = import_graph()
    assert "dflash_train.model.target.target" in graph["dflash_train.model.target.load"]  # the graph is read
    assert cycles(graph) == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(graph))
