"""The shape of the repository, read from the source with `ast` (nothing is imported).

The teaching core sits on top of nanohlat/ and stays small; tooling lives in
subpackages (system/, tools/, run/, serving/, classroom/, ...) and hooks into the
core from outside. docs/design.md 1 states the rules; these tests keep them:

- the top level holds at most MAX_CORE_MODULES modules (tests/repo/test_core_cap.py caps their code);
- no module under nanohlat/, at any depth, is longer than MAX_MODULE_LINES lines;
- no file under tests/ is longer than MAX_TEST_FILE_LINES lines, and no two .py files there
  share a name (conftest.py puts every test folder on sys.path);
- no top-level module imports from a subpackage, not even inside a function;
- the subpackages stand in one strict order of floors (FLOORS, drawn in the same
  order in docs/design.md 1), and no module imports from a floor above its own;
- no import cycle among the modules of nanohlat/ (function-level imports count);
- each subpackage says what it holds in its __init__.py's docstring;
- README.md's reading-order table gives each core file's true length;
- the core keeps no module-level mutable state (no `global`, nothing written into a
  module-level name: test_the_core_keeps_no_module_level_state says exactly what counts).

An import here is any `import` / `from ... import` anywhere in a file (relative
ones resolved), and `importlib.import_module("nanohlat....")` with a literal name.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "nanohlat")

MAX_CORE_MODULES = 14      # nanohlat/*.py besides __init__.py: the design card's core, one idea a file
# optim: ~230 asked, + the 20-line reference AdamW, the flat parameter buffers and XLA's in-graph gather/scatter
# of them, + ZeRO-3's per-layer groups and kept shard (5), + expert parallelism's own reduction group for the
# experts and their term in the grad norm (6), + the experts under ZeRO (their own sharded strategy, the norm) (3),
# + MoE with --tp: the experts are whole on every tp rank, partial under SP (1), + the step hooks (5)
MAX_LINES = {"train.py": 130, "nanohlat/optim.py": 320}
MAX_MODULE_LINES = 600     # any module under nanohlat/, at any depth: one idea a file; a longer one is split
                           # along its seam (tools/timeline.py, 701 lines, became timeline.py and comm_trace.py)

# The floors, lowest first: (name, the folders of nanohlat/ on it). A module imports only from
# its own floor or one below it. The core is nanohlat/*.py; the commands are the top floor:
# train.py, sample.py, eval.py, the packages that only name a `python -m` command, and every
# __main__.py. docs/design.md 1 says what lives on each floor, in this order.
FLOORS = (
    ("core", ()),
    ("beyond", ("beyond",)),
    ("system", ("system",)),
    ("recipe", ("recipe",)),
    ("tools", ("tools",)),
    ("plan", ("plan",)),
    ("run", ("run",)),
    ("serving", ("serving",)),
    ("classroom", ("classroom",)),
    ("commands", ("bench", "figures", "hf", "harness")),
)
SCRIPTS = ("train.py", "sample.py", "eval.py")   # the commands outside nanohlat/


def count_lines(path: str) -> int:
    """What `wc -l` prints: the number of newline characters."""
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def relpath(path: str) -> str:
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def core_files() -> list[str]:
    """nanohlat/*.py besides __init__.py, sorted."""
    return sorted(os.path.join(PACKAGE, name) for name in os.listdir(PACKAGE)
                  if name.endswith(".py") and name != "__init__.py")


def subpackages() -> list[str]:
    """The folders of nanohlat/ that are packages (hold an __init__.py): 'run', 'tools', ..."""
    return sorted(name for name in os.listdir(PACKAGE)
                  if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py")))


def all_modules() -> dict[str, str]:
    """Every module under nanohlat/: dotted name -> file ('nanohlat.run' -> .../run/__init__.py)."""
    modules = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = relpath(path)[:-len(".py")].split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


class Import:
    """One import statement: who imports what, where (file:line, enclosing function)."""

    def __init__(self, source: str, target: str, path: str, line: int, where: str):
        self.source, self.target, self.path, self.line, self.where = source, target, path, line, where

    def __str__(self):
        inside = f" (inside {self.where})" if self.where else " (at module level)"
        return f"{relpath(self.path)}:{self.line} imports {self.target}{inside}"


def imports_of(module: str, path: str, modules: dict[str, str]) -> list[Import]:
    """The nanohlat modules that `module` (the file at `path`) imports, anywhere in it.

    `from X import Y` imports X.Y when that is a module, else X; `import X.Y.Z`
    imports X.Y.Z. Names outside nanohlat are dropped."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def add(target: str, node: ast.AST, where: str):
        # the longest prefix of `target` that is a nanohlat module
        parts = target.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            found.append(Import(module, ".".join(parts), path, node.lineno, where))

    def visit(node: ast.AST, where: str):
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, inner)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    origin = ".".join(base + ([child.module] if child.module else []))
                else:
                    origin = child.module or ""
                for alias in child.names:
                    if f"{origin}.{alias.name}" in modules:
                        add(f"{origin}.{alias.name}", child, inner)
                    else:
                        add(origin, child, inner)
            elif (isinstance(child, ast.Call) and child.args
                  and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str)
                  and ast.unparse(child.func) in ("importlib.import_module", "import_module",
                                                  "__import__")):
                add(child.args[0].value, child, inner)
            visit(child, inner)

    visit(tree, "")
    return found


def import_graph(scripts: bool = False) -> tuple[dict[str, str], list[Import]]:
    """(module -> file, every import among them); with `scripts`, train.py,
    sample.py and eval.py count as modules too ('train', ...)."""
    modules = all_modules()
    if scripts:
        modules.update({name[:-len(".py")]: os.path.join(ROOT, name) for name in SCRIPTS})
    edges = []
    for name, path in modules.items():
        edges += [e for e in imports_of(name, path, modules) if e.target != name]
    return modules, edges


def find_cycles(modules, edges: list[Import]) -> list[list[Import]]:
    """One cycle (as its chain of imports) per strongly connected component of the graph."""
    out: dict[str, list[Import]] = {m: [] for m in modules}
    for e in edges:
        out[e.source].append(e)
    # Tarjan's strongly connected components, iteratively
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(out[node]):
                work.append((node, i + 1))
                nxt = out[node][i].target
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    cycles = []
    for component in components:
        # the shortest way from the component's first module back to itself
        start = min(component)
        paths = {start: []}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            following = []
            for node in frontier:
                for e in out[node]:
                    if e.target not in component:
                        continue
                    if e.target == start:
                        cycle = paths[node] + [e]
                        break
                    if e.target not in paths:
                        paths[e.target] = paths[node] + [e]
                        following.append(e.target)
                if cycle:
                    break
            frontier = following
        cycles.append(cycle)
    return cycles


def test_the_core_on_top_is_small():
    files = core_files()
    lines = {relpath(p): count_lines(p) for p in files}
    listing = ", ".join(f"{name} {n}" for name, n in lines.items())
    assert len(files) <= MAX_CORE_MODULES, (
        f"nanohlat/ holds {len(files)} modules besides __init__.py, at most {MAX_CORE_MODULES} "
        f"allowed (tooling belongs in a subpackage): {listing}")


def comment_lines(source: str) -> int:
    """Lines of `source` inside a docstring (module, class, function) or carrying a comment, whole-line or inline."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    lines.update(tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type == tokenize.COMMENT)
    return len(lines)


def core_sources() -> list[str]:
    """train.py and nanohlat/*.py: the core."""
    return [os.path.join(ROOT, "train.py")] + core_files() + [os.path.join(PACKAGE, "__init__.py")]


def test_the_comment_count_sees_docstrings_and_comments():
    source = 'x = 1  # one\n"""not a docstring: an expression after code"""\ndef f():\n    """a\n    b"""\n    return 2\n'
    assert comment_lines(source) == 3   # the inline comment, the function's docstring over two lines


def beyond_names() -> dict[str, list[str]]:
    """What the core must not name, read from the source: each module of nanohlat/beyond/ (as a
    module: `moe.py`, `moe.`, an import of it), each class it defines, and each field (flag) that
    nanohlat/recipe/configs.py adds to config.py's dataclasses, as a flag (`--moe-experts`) or an attribute
    (`.moe_experts`)."""
    folder = os.path.join(PACKAGE, "beyond")
    modules = sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py") and n != "__init__.py")
    classes = []
    for m in modules:
        with open(os.path.join(folder, m + ".py"), encoding="utf-8") as f:
            classes += [n.name for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef)
                        and not n.name.startswith("_")]   # (its own helpers may share a name with the core's)
    with open(os.path.join(PACKAGE, "recipe", "configs.py"), encoding="utf-8") as f:
        recipe = ast.parse(f.read())
    fields = [t.target.id for cls in recipe.body if isinstance(cls, ast.ClassDef)
              and cls.name in ("ModelConfig", "TrainConfig") for t in cls.body if isinstance(t, ast.AnnAssign)]
    return {"modules": ["beyond"] + modules, "classes": classes, "fields": fields}


def named_beyond(source: str, names: dict) -> list[str]:
    """The places `source` names something of nanohlat/beyond/ (beyond_names), as 'line: what'."""
    found = []
    for n, line in enumerate(source.splitlines(), 1):
        for m in names["modules"]:
            if re.search(rf"\b{m}(\.py\b|\.[A-Za-z_]|/)|(from|import)\s[^#\n]*\b{m}\b", line):
                found.append(f"{n}: module {m}")
        found += [f"{n}: class {c}" for c in names["classes"] if re.search(rf"\b{c}\b", line)]
        for f in names["fields"]:
            flag = "--" + f.replace("_", "-")
            if re.search(rf"(?<![\w-]){re.escape(flag)}\b|\.{f}\b", line):
                found.append(f"{n}: flag {flag}")
    return found


def test_the_core_names_nothing_beyond_it():
    """The core reads as if nothing else existed: no file of it imports nanohlat/beyond/ or names one
    of its modules, classes or flags, in code or in comments (run/build.py applies them from outside)."""
    names = beyond_names()
    assert len(names["modules"]) >= 7 and "MoE" in names["classes"] and "cp" in names["fields"], names
    found = []
    for path in core_sources():
        with open(path, encoding="utf-8") as f:
            found += [f"{relpath(path)}:{where}" for where in named_beyond(f.read(), names)]
    assert not found, ("the core names what lies beyond it (apply it from outside, run/build.py; say what a seam "
                       "is for without naming who uses it):\n  " + "\n  ".join(found))


def test_the_beyond_check_sees_a_name():
    names = beyond_names()
    planted = ("from nanohlat.beyond import moe\nx = tcfg.cp\n# see context_parallel.py\ny = MoE(1)\n"
               "# --moe-experts 4\nz = 1  # the schedules of a pipeline, in words\n")
    assert [w.split(":")[0] for w in named_beyond(planted, names)] == ["1", "1", "2", "3", "4", "5"]


def test_entry_and_optimizer_files_stay_short():
    too_long = [f"{name}: {count_lines(os.path.join(ROOT, name))} lines, at most {limit}"
                for name, limit in MAX_LINES.items()
                if count_lines(os.path.join(ROOT, name)) > limit]
    assert not too_long, "; ".join(too_long)


def test_no_module_is_longer_than_max_module_lines():
    """Every .py file under nanohlat/ (any depth) holds at most MAX_MODULE_LINES lines (`wc -l`)."""
    too_long = sorted((count_lines(path), relpath(path)) for path in all_modules().values()
                      if count_lines(path) > MAX_MODULE_LINES)
    assert not too_long, (f"{len(too_long)} module(s) under nanohlat/ longer than {MAX_MODULE_LINES} lines (split "
                          f"each along its seam, one idea a file): "
                          + ", ".join(f"{name} {n} lines" for n, name in reversed(too_long)))


MAX_TEST_FILE_LINES = 800  # any file under tests/, at any depth


def files_under(root: str) -> list[str]:
    """Every file under `root` (the tests: their modules, helpers and data), __pycache__ left out."""
    return sorted(os.path.join(folder, name) for folder, dirs, names in os.walk(root)
                  if "__pycache__" not in folder.split(os.sep) for name in names)


def long_test_files(root: str) -> list[str]:
    return [f"{os.path.relpath(path, root)} {count_lines(path)} lines" for path in files_under(root)
            if count_lines(path) > MAX_TEST_FILE_LINES]


def shared_module_names(root: str) -> list[str]:
    """The .py file names that stand in more than one folder under `root`, with their folders."""
    folders: dict[str, list[str]] = {}
    for path in files_under(root):
        if path.endswith(".py"):
            folders.setdefault(os.path.basename(path), []).append(os.path.relpath(os.path.dirname(path), root))
    return [f"{name} in {', '.join(where)}" for name, where in sorted(folders.items()) if len(where) > 1]


def test_no_test_file_is_longer_than_max_test_file_lines():
    """Every file under tests/ holds at most MAX_TEST_FILE_LINES lines (`wc -l`). The tests stand in
    folders that mirror nanohlat's floors, each file named for what it tests, so that a reader
    finds the test of a promise by its file's name and can read that file through. A file past
    800 lines holds several subjects under one name (test_robustness.py had grown to 1,616
    lines: flags, full disks, damaged files, signals and launchers); such a file is split along its
    sections into files named for them, the helpers and fixtures they share in a plain module
    beside them (tests/run/hostile.py, tests/plan/plan_utils.py: not a test_*.py, and not a second
    conftest.py, which would clash with the first as a module named `conftest`)."""
    too_long = long_test_files(os.path.join(ROOT, "tests"))
    assert not too_long, (f"file(s) under tests/ longer than {MAX_TEST_FILE_LINES} lines (split each along its "
                          f"sections, shared helpers in a plain module beside them): " + ", ".join(too_long))


def test_no_two_test_modules_share_a_name():
    """No two .py files under tests/ share a file name, whatever their folders. tests/conftest.py puts
    every folder of tests/ on sys.path, and the tests import their helpers and each other by bare
    module name (`from hostile import ...`, `from test_watchdog import _stopping_worker`, the
    `python -c` launchers of test_signals_and_launchers.py, gloo workers unpickled by module name);
    pytest's default import mode imports each test file by its bare name too. Two files of one name
    would be one module: whichever is imported first stands for both (pytest stops the run with
    "import file mismatch")."""
    shared = shared_module_names(os.path.join(ROOT, "tests"))
    assert not shared, "module names used twice under tests/ (rename one of each): " + "; ".join(shared)


def test_the_test_file_checks_see_a_long_file_and_a_shared_name(tmp_path):
    for folder in ("run", "plan", "plan/__pycache__"):
        (tmp_path / folder).mkdir()
    (tmp_path / "run" / "helpers.py").write_text("x = 1\n" * MAX_TEST_FILE_LINES)
    (tmp_path / "plan" / "helpers.py").write_text("x = 1\n" * (MAX_TEST_FILE_LINES + 1))
    (tmp_path / "plan" / "__pycache__" / "helpers.py").write_text("x = 1\n" * 10_000)   # not a test file
    assert long_test_files(str(tmp_path)) == [f"plan/helpers.py {MAX_TEST_FILE_LINES + 1} lines"]
    assert shared_module_names(str(tmp_path)) == ["helpers.py in plan, run"]


def test_the_model_does_not_generate():
    """Generation (sampling loops, KV-cache decoding) is serving/generate.py's, not the model's."""
    path = os.path.join(PACKAGE, "model.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = [f"nanohlat/model.py:{item.lineno} {cls.name}.generate"
             for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
             for item in cls.body
             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "generate"]
    assert not found, f"model.py defines a method named generate: {', '.join(found)}"


def test_no_core_module_imports_from_a_subpackage():
    modules, edges = import_graph()
    subs = tuple(f"nanohlat.{name}" for name in subpackages())
    assert subs, "no subpackage found under nanohlat/"
    core = {m for m, p in modules.items() if os.path.dirname(p) == PACKAGE}
    bad = [e for e in edges if e.source in core
           and any(e.target == s or e.target.startswith(s + ".") for s in subs)]
    assert not bad, ("a top-level module of nanohlat/ imports from a subpackage "
                     f"({', '.join(subs)}); hook the tool in from outside instead:\n  "
                     + "\n  ".join(str(e) for e in bad))


def floor_of(module: str, path: str) -> int | None:
    """The index in FLOORS of the floor `module` (its file: `path`) is on; None for a
    subpackage on no floor."""
    if module.rpartition(".")[2] == "__main__" or relpath(path) in SCRIPTS:
        return len(FLOORS) - 1
    if os.path.dirname(path) == PACKAGE:   # nanohlat/*.py and nanohlat/__init__.py
        return 0
    folder = relpath(path).split("/")[1]
    return next((i for i, (_, folders) in enumerate(FLOORS) if folder in folders), None)


def climbs(modules: dict[str, str], edges: list[Import]) -> list[str]:
    """Each import from a floor below the floor of what it imports, as one line."""
    bad = []
    for e in edges:
        low, high = floor_of(e.source, modules[e.source]), floor_of(e.target, modules[e.target])
        if low is not None and high is not None and high > low:
            inside = f" inside {e.where}" if e.where else ""
            bad.append(f"{relpath(e.path)}:{e.line}{inside}: {e.source} (floor {FLOORS[low][0]}) imports "
                       f"{e.target} (floor {FLOORS[high][0]}, above it)")
    return bad


def test_every_subpackage_is_on_a_floor():
    lost = [f"nanohlat/{name}/" for name in subpackages()
            if not any(name in folders for _, folders in FLOORS)]
    assert not lost, (f"{', '.join(lost)} on no floor: put each in tests/repo/test_structure.py's FLOORS and say in "
                      f"docs/design.md 1 what lives there")


def test_no_module_imports_from_a_floor_above_its_own():
    """The floors, lowest first: core < system < tools < run < serving < classroom < the commands.
    A function-level import counts as much as one at the top of the file."""
    modules, edges = import_graph(scripts=True)
    bad = climbs(modules, edges)
    assert not bad, (f"{len(bad)} import(s) climb to a higher floor (FLOORS, docs/design.md 1): move what is "
                     f"imported down, or the importer up:\n  " + "\n  ".join(bad))


def test_the_floor_check_sees_a_climb():
    """climbs() on two planted imports: run/ into classroom/ inside a function (a climb), and
    classroom/ into run/ (down: allowed)."""
    modules = {"nanohlat.run.launch": os.path.join(PACKAGE, "run", "launch.py"),
               "nanohlat.classroom": os.path.join(PACKAGE, "classroom", "__init__.py")}
    up = Import("nanohlat.run.launch", "nanohlat.classroom", modules["nanohlat.run.launch"], 7, "worker_stub")
    down = Import("nanohlat.classroom", "nanohlat.run.launch", modules["nanohlat.classroom"], 3, "")
    assert climbs(modules, [up, down]) == [
        "nanohlat/run/launch.py:7 inside worker_stub: nanohlat.run.launch (floor run) imports "
        "nanohlat.classroom (floor classroom, above it)"]


def test_design_notes_draw_the_floors_in_order():
    """docs/design.md 1's table of floors names each floor's folders in FLOORS' order."""
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        text = f.read()
    assert "\n**The floors.**" in text, "docs/design.md 1 has no '**The floors.**' paragraph and table"
    rows = []
    for line in text.split("\n**The floors.**", 1)[1].splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:   # the end of the first table after the heading
            break
    order = []
    for _, folders in FLOORS[1:]:
        found = [i for i, row in enumerate(rows) for folder in folders if f"`{folder}/`" in row.split("|")[1]]
        assert found, f"docs/design.md's floors table has no row for {', '.join(f + '/' for f in folders)}"
        order.append(min(found))
    assert order == sorted(order), ("docs/design.md's floors table draws the floors in another order than "
                                    "tests/repo/test_structure.py's FLOORS")


def test_no_import_cycles():
    modules, edges = import_graph()
    cycles = find_cycles(modules, edges)
    message = []
    for cycle in cycles:
        chain = " -> ".join([cycle[0].source] + [e.target for e in cycle])
        message.append(f"cycle {chain}:\n    " + "\n    ".join(str(e) for e in cycle))
    assert not cycles, f"{len(cycles)} import cycle(s) among nanohlat's modules:\n  " + "\n  ".join(message)


def test_each_subpackage_says_what_it_holds():
    missing = []
    for name in subpackages():
        path = os.path.join(PACKAGE, name, "__init__.py")
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        if len(" ".join(doc.split())) < 60:
            missing.append(f"nanohlat/{name}/__init__.py ({len(doc)} characters)")
    assert not missing, ("each subpackage's __init__.py opens with a docstring paragraph "
                         "(at least 60 characters) saying what it holds: " + ", ".join(missing))


def reading_order() -> list[tuple[str, int]]:
    """(file, lines) of each row of README.md's reading-order table."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = re.search(r"^## Reading order\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Reading order' section"
    rows = []
    for line in section.group(1).splitlines():
        match = re.match(r"\|\s*(?:\d+\s*\|)?\s*`([^`]+\.py)`\s*\|\s*(\d+)\s*\|", line)
        if match:
            rows.append((match.group(1), int(match.group(2))))
    return rows


def test_readme_reading_order_gives_true_line_counts():
    rows = reading_order()
    assert len(rows) >= 10, f"README.md's reading-order table has {len(rows)} rows"
    wrong = []
    for name, claimed in rows:
        path = os.path.join(ROOT, name)
        assert os.path.isfile(path), f"README.md's reading order names {name}, which does not exist"
        actual = count_lines(path)
        if abs(actual - claimed) > max(15, 0.10 * actual):
            wrong.append(f"{name}: README says {claimed}, wc -l says {actual}")
    assert not wrong, ("README.md's reading-order table is out of date (more than 10% or 15 "
                       "lines off); write these numbers:\n  " + "\n  ".join(wrong))
    core = {relpath(p) for p in core_files()} | {"train.py"}
    unlisted = sorted(core - {name for name, _ in rows})
    assert not unlisted, f"README.md's reading order leaves out {', '.join(unlisted)}"


MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
            "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"}


def core_state_findings(root: str = ROOT) -> list[str]:
    """Module-level mutable state in the core (nanohlat/*.py), as test_the_core_keeps_no_module_level_state
    defines it; one line per finding."""
    package = os.path.join(root, "nanohlat")
    core = {f"nanohlat.{name[:-3]}": os.path.join(package, name) for name in sorted(os.listdir(package))
            if name.endswith(".py") and name != "__init__.py"}
    findings, bound = [], {}               # bound: core module -> its module-level names (not def, class, import)
    for module, path in core.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        names = set()
        for node in tree.body:
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        bound[module] = names
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                findings.append(f"{relpath(path)}:{node.lineno}: `global {', '.join(node.names)}`")
    sources = [os.path.join(root, name) for name in ("train.py", "sample.py", "eval.py")]
    sources += [os.path.join(folder, name) for folder, _, files in os.walk(package) for name in files
                if name.endswith(".py") and "__pycache__" not in folder]
    for path in sorted(p for p in sources if os.path.isfile(p)):
        rel = os.path.relpath(path, root)[:-len(".py")].split(os.sep)
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        package_of = module if rel[-1] == "__init__" else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        modules = {}                       # local name -> the core module it is
        names = {n: (module, n) for n in bound.get(module, ())}   # local name -> (core module, its name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in core:
                        modules[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = package_of.split(".")[:len(package_of.split(".")) - node.level + 1] if node.level else []
                origin = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{origin}.{a.name}" in core:
                        modules[a.asname or a.name] = f"{origin}.{a.name}"
                    elif origin in core and a.name in bound[origin]:
                        names[a.asname or a.name] = (origin, a.name)

        def root_of(expr):
            """The core module-level name an attribute / item chain starts from, or None."""
            while isinstance(expr, (ast.Attribute, ast.Subscript)):
                if (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
                        and expr.value.id in modules and expr.attr in bound[modules[expr.value.id]]):
                    return modules[expr.value.id], expr.attr
                expr = expr.value
            return names.get(expr.id) if isinstance(expr, ast.Name) else None

        def note(node, what, hit):
            if hit:
                findings.append(f"{relpath(path)}:{node.lineno}: {what} {hit[0]}.{hit[1]}")

        def flat(targets):                 # a, (b.c, d[0]) = ...: each target on its own
            for t in targets:
                if isinstance(t, (ast.Tuple, ast.List)):
                    yield from flat(t.elts)
                else:
                    yield t.value if isinstance(t, ast.Starred) else t

        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                for t in flat(node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                    if isinstance(t, (ast.Attribute, ast.Subscript)):
                        note(node, "writes into", root_of(t))
                    elif isinstance(t, ast.Name) and isinstance(node, ast.AugAssign):
                        note(node, "updates", names.get(t.id))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                note(node, f"calls .{node.func.attr}() of", root_of(node.func.value))
    return findings


def test_the_core_keeps_no_module_level_state():
    """Nothing global (docs/design.md section 1): the core keeps no module-level
    mutable state, read from the source with ast. A finding is

    - a `global` statement anywhere in a core module (nanohlat/*.py): a function
      rebinding a module-level name;
    - a write into a core module's module-level name from anywhere in the
      package or its entry points (train.py, sample.py, eval.py): an item or
      attribute assignment, `del` or augmented assignment on it or on anything
      reached from it (`NAME[k] = ...`, `NAME.a.b = ...`, `mod.NAME.a = ...`,
      through any import of it), or a call of a mutating method on it
      (append, extend, insert, pop, popitem, remove, clear, update, setdefault,
      add, discard, sort, reverse, __setitem__, __delitem__).

    Allowed: constants and tables that nothing writes into (numbers, strings,
    tuples, the PRESETS and HELP dicts read by config.py, functions picked once
    at import as comm.py's), functions and classes. The tests' own
    monkeypatching is not the package's state and is not read."""
    findings = core_state_findings()
    assert not findings, ("module-level mutable state in the core (own it in an object passed to whoever "
                          "needs it):\n  " + "\n  ".join(findings))


def test_the_state_finder_finds_state(tmp_path):
    """core_state_findings on a planted package: a `global`, a module-level dict
    written into in place, from its own module, through a module import and
    through a name import, are found; a table that is only read is not."""
    (tmp_path / "nanohlat").mkdir()
    (tmp_path / "nanohlat" / "a.py").write_text(
        "CACHE = {}\nTABLE = {'k': 1}\nFLAG = False\n\n"
        "def f():\n    CACHE['x'] = TABLE['k']\n\n"
        "def g():\n    global FLAG\n    FLAG = True\n")
    (tmp_path / "nanohlat" / "b.py").write_text(
        "from . import a\nfrom .a import CACHE, TABLE\n\n"
        "def h():\n    a.CACHE.clear()\n    CACHE.update(TABLE)\n    return TABLE.get('k')\n")
    found = [line.split(": ", 1)[1] for line in core_state_findings(str(tmp_path))]
    assert sorted(found) == sorted(["`global FLAG`", "writes into nanohlat.a.CACHE",
                                    "calls .clear() of nanohlat.a.CACHE", "calls .update() of nanohlat.a.CACHE"]), found
