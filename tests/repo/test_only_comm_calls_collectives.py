"""Only nanohlat/comm.py calls torch.distributed's collectives (docs/design.md, section 1).

Read from the source: every module of nanohlat/ and every script at the
repository root, parsed with `ast`. A call counts when it is a collective's
name reached through torch.distributed, however it was imported:
`dist.all_reduce(...)` after `import torch.distributed as dist`,
`torch.distributed.broadcast(...)`, or `barrier()` after
`from torch.distributed import barrier`.
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "broadcast_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier"}


def _sources() -> list[str]:
    paths = [os.path.join(REPO, n) for n in sorted(os.listdir(REPO)) if n.endswith(".py")]
    for root, dirs, files in os.walk(os.path.join(REPO, "nanohlat")):
        dirs.sort()
        paths += [os.path.join(root, n) for n in sorted(files) if n.endswith(".py")]
    return paths


def _dotted(node) -> str | None:
    """`a.b.c` of an ast Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) of every torch.distributed collective called in `source`."""
    tree = ast.parse(source)
    modules = {"torch.distributed"}   # names bound to torch.distributed
    functions = {}                    # names bound to one of its collectives
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module == "torch.distributed" and a.name in COLLECTIVES:
                    functions[a.asname or a.name] = a.name
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _dotted(f.value) in modules:
            calls.append((node.lineno, f"{_dotted(f.value)}.{f.attr}"))
        elif isinstance(f, ast.Name) and f.id in functions:
            calls.append((node.lineno, functions[f.id]))
    return calls


def test_the_check_sees_every_spelling():
    src = ("import torch.distributed as dist\nimport torch\nfrom torch import distributed as td\n"
           "from torch.distributed import barrier as b\n"
           "dist.all_reduce(x)\ntorch.distributed.broadcast(x, 0)\ntd.send(x, 1)\nb()\n"
           "dist.init_process_group('gloo')\ndist.new_group([0])\ndist.is_initialized()\n")
    assert [line for line, _ in collective_calls(src)] == [5, 6, 7, 8]


def test_only_comm_py_calls_collectives():
    found = []
    for path in _sources():
        if os.path.relpath(path, REPO) == os.path.join("nanohlat", "comm.py"):
            continue
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, REPO)}:{line}: {what}" for line, what in collective_calls(f.read())]
    assert not found, "collectives outside nanohlat/comm.py (route them through comm.py):\n" + "\n".join(found)


def test_comm_py_does_call_them():
    """The check is not vacuous: comm.py's own calls are found."""
    with open(os.path.join(REPO, "nanohlat", "comm.py"), encoding="utf-8") as f:
        assert any(what.endswith("all_reduce") for _, what in collective_calls(f.read()))
