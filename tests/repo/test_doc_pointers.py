"""Every code pointer in the prose points at something that exists (read with `ast`; nothing is imported).

The prose is README.md, tutorial.md, docs/*.md and the docstrings and comments of
train.py, sample.py, eval.py and nanohlat/**/*.py. A code pointer is

  * a file: `optim.py`, `run/checkpoint.py`, `nanohlat/plan.py`, `tests/core/test_xla.py`;
  * a file and a top-level name in it: `optim.py:FlatAdamW`, `tools/fast_adamw.py:CPU_BLOCK`;
  * a file, a class and a method (or class attribute): `optim.py:FlatAdamW.update`.

A path with a folder is read from the repository root or from nanohlat/. A bare
file name is looked up in the root, nanohlat/ and its subfolders (and tests/,
scripts/); it must match exactly one file, else the pointer needs its folder.
Names are found in the file's top-level statements (def, class, assignment);
an imported name does not count: a pointer names where a thing is defined.

Pointers into other projects (torch, torch_xla) and the few words that only
look like pointers are in ALLOWED below, each with its reason.
"""

from __future__ import annotations

import ast
import glob
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "nanohlat")

# A path of word characters and slashes ending in .py, optionally `:Name` or `:Class.method`.
# Not preceded by a path character, so `torch_xla/runtime.py` is one pointer, not `runtime.py`.
POINTER = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?))?(?![\w/])")

# (pointer as written, start of its path) that are not pointers into this repository.
ALLOWED = {
    "file.py:function": "tutorial.md explains the pointer notation itself",
    "torch_xla/": "docs/trn1.md cites torch_xla's own source",
    "torch/": "docs/trn1.md cites torch's own source",
    "megatron/": "tensor_parallel.py names Megatron-LM's file with the same four functions",
}


def prose_files() -> list[str]:
    """The Markdown files and the Python files whose docstrings and comments are read."""
    md = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "tutorial.md")]
    md += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    py = [os.path.join(ROOT, name) for name in ("train.py", "sample.py", "eval.py")]
    py += sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))
    return md + py


def markdown_lines(path: str):
    """(line number, text) of every line of a Markdown file."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            yield number, line


def python_prose_lines(path: str):
    """(line number, text) of every line of the docstrings (any string statement) and comments."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    docstrings = {(node.lineno, node.col_offset) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in docstrings):
            for offset, line in enumerate(tok.string.split("\n")):
                yield tok.start[0] + offset, line


def pointers(path: str):
    """(line number, pointer, file part, name part or None) of each pointer in one prose file."""
    lines = markdown_lines(path) if path.endswith(".md") else python_prose_lines(path)
    for number, line in lines:
        for m in POINTER.finditer(line):
            yield number, m.group(0), m.group(1), m.group(2)


def search_folders() -> list[str]:
    """Where a bare file name is looked up: the root, nanohlat/, its subfolders, tests/ and its
    folders, scripts/."""
    def below(folder):
        return sorted(os.path.join(folder, d) for d in os.listdir(folder)
                      if os.path.isdir(os.path.join(folder, d)) and d != "__pycache__")
    tests = os.path.join(ROOT, "tests")
    return [ROOT, PACKAGE] + below(PACKAGE) + [tests] + below(tests) + [os.path.join(ROOT, "scripts")]


def resolve(file_part: str, near: str | None = None) -> tuple[str | None, str]:
    """(the file a pointer's path names, or None and why not). In a .py file (`near`), a
    bare name is first looked up next to that file: `__main__.py` in a __main__.py is itself."""
    if near and "/" not in file_part and os.path.isfile(os.path.join(os.path.dirname(near), file_part)):
        return os.path.join(os.path.dirname(near), file_part), ""
    if "/" in file_part:
        found = [p for p in (os.path.join(ROOT, file_part), os.path.join(PACKAGE, file_part))
                 if os.path.isfile(p)]
    else:
        found = [os.path.join(d, file_part) for d in search_folders()
                 if os.path.isfile(os.path.join(d, file_part))]
    if len(found) == 1:
        return found[0], ""
    if not found:
        return None, "no such file"
    names = ", ".join(os.path.relpath(p, ROOT) for p in found)
    return None, f"ambiguous without its folder ({names})"


_definitions: dict[str, dict[str, set[str]]] = {}


def definitions(path: str) -> dict[str, set[str]]:
    """Top-level names defined in a file -> the names defined in its body (methods, attributes)."""
    if path not in _definitions:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        _definitions[path] = {}
        _collect(tree.body, _definitions[path])
    return _definitions[path]


def _assigned(node) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _collect(body, into: dict[str, set[str]]) -> None:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            into.setdefault(node.name, set())
        elif isinstance(node, ast.ClassDef):
            members = into.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                members.update(_assigned(item))
        elif isinstance(node, (ast.If, ast.Try)):   # `if ...: X = ...`, `try: import ... except: ...`
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                _collect(block, into)
        else:
            for name in _assigned(node):
                into.setdefault(name, set())


def check(file_part: str, name: str | None, near: str | None = None) -> str:
    """'' if the pointer holds, else what is wrong."""
    path, why = resolve(file_part, near)
    if path is None:
        return why
    if name is None:
        return ""
    top, _, member = name.partition(".")
    defs = definitions(path)
    shown = os.path.relpath(path, ROOT)
    if top not in defs:
        return f"{shown} defines no {top}"
    if member and member not in defs[top]:
        return f"{shown}: {top} has no {member}"
    return ""


def allowed(pointer: str) -> bool:
    return any(pointer == a or (a.endswith("/") and pointer.startswith(a)) for a in ALLOWED)


def broken_pointers() -> list[str]:
    broken = []
    for path in prose_files():
        for line, pointer, file_part, name in pointers(path):
            if allowed(pointer):
                continue
            problem = check(file_part, name, path if path.endswith(".py") else None)
            if problem:
                broken.append(f"{os.path.relpath(path, ROOT)}:{line}: `{pointer}`: {problem}")
    return broken


def test_every_code_pointer_in_the_prose_exists():
    broken = broken_pointers()
    assert not broken, (f"{len(broken)} code pointer(s) in the prose point at nothing "
                        "(fix the prose, or add to ALLOWED in tests/repo/test_doc_pointers.py with a reason):\n  "
                        + "\n  ".join(broken))


def test_the_pointer_finder_finds_pointers():
    """The scan itself works: it finds the forms it claims to, and resolves them."""
    found = [m.group(0) for m in POINTER.finditer(
        "see `optim.py:FlatAdamW.update`, run/checkpoint.py, nanohlat/plan.py's and "
        "`torch_xla/runtime.py:f`; not python -m nanohlat.bench")]
    assert found == ["optim.py:FlatAdamW.update", "run/checkpoint.py", "nanohlat/plan.py",
                     "torch_xla/runtime.py:f"]
    assert check("optim.py", "FlatAdamW.update") == ""
    assert check("optim.py", "FlatAdamW.no_such_method") != ""
    assert check("no_such_file.py", None) == "no such file"
    assert check("__init__.py", None).startswith("ambiguous")
    assert sum(1 for path in prose_files() for _ in pointers(path)) > 300
