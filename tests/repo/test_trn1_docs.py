"""docs/trn1.md against what it describes: the plan's figures in section 11
(re-run from the commands the section shows) and the pinned trn1 stack
(constraints/trn1-neuron-2.29.txt).

The plan figures in the doc's table are what `train.py --plan` prints for the
commands above the table: the step time and tokens/s of the NeuronCore-v2 row,
sequences/s = tokens/s / sequence length, and the ratio to the published
figure. A change to the plan that moves any of them fails here until the doc
says the new figure, so the comparison cannot go stale.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from conftest import ROOT

DOC = os.path.join(ROOT, "docs", "trn1.md")
CONSTRAINTS = os.path.join(ROOT, "constraints", "trn1-neuron-2.29.txt")


def section(title: str) -> str:
    """The text of docs/trn1.md's section whose heading starts with `title`."""
    with open(DOC) as f:
        text = f.read()
    start = text.index("\n## " + title)
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def plan_commands(text: str) -> dict[str, list[str]]:
    """{row name: train.py's arguments} from the section's bash block, where
    each command follows a `# <row name>` comment."""
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    out, name = {}, None
    for line in block.splitlines():
        if line.startswith("# "):
            name = line[2:].strip()
        elif line.startswith("python train.py "):
            out[name] = shlex.split(line)[2:]
    return out


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """{model: {column: cell}} from the section's markdown table."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {r[0]: dict(zip(header, r)) for r in rows}


def neuroncore_row(out: str) -> list[str]:
    """The NeuronCore-v2 row of the printed time estimate, as columns."""
    start = out.index("estimated time per step")
    line = next(l for l in out[start:].splitlines() if l.startswith("  NeuronCore-v2 "))
    return re.split(r"\s{2,}", line.strip())


PLAN = section("11. The plan against published trn1 figures")


def test_the_section_has_a_command_for_every_row():
    assert set(plan_commands(PLAN)) == set(table_rows(PLAN)) == {"Llama-3.1-8B", "Llama-3-70B"}


@pytest.mark.parametrize("model", ["Llama-3.1-8B", "Llama-3-70B"])
def test_the_docs_plan_figures_are_what_the_plan_prints(model, capsys):
    import train
    argv = plan_commands(PLAN)[model]
    assert "--plan" in argv
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    row = table_rows(PLAN)[model]
    # device, peak, compute, tp comm, pp exchange, dp comm, bubble, step, tokens/s, ...
    cols = neuroncore_row(out)
    step, tokens_per_s = cols[7], cols[8]
    assert row["plan: step"] == step
    assert row["plan: tokens/s"] == tokens_per_s
    seq_len = int(argv[argv.index("--seq-len") + 1])
    seqs = int(tokens_per_s.replace(",", "")) / seq_len
    assert row["plan: seq/s"] == f"{seqs:.2f}"
    published = float(row["published seq/s (Neuron 2.24.0)"])
    assert row["plan / published"] == f"{float(row['plan: seq/s']) / published:.2f}"
    # the layout the row names is the layout the command plans
    world = int(argv[argv.index("--nproc") + 1])
    assert world == 32 * 32                                   # 32 trn1.32xlarge
    tp, pp = int(argv[argv.index("--tp") + 1]), int(argv[argv.index("--pp") + 1])
    assert f"tp {tp}" in row["layout (32 trn1.32xlarge)"]
    assert f"dp {world // (tp * pp)}" in row["layout (32 trn1.32xlarge)"]
    assert (f"pp {pp}" in row["layout (32 trn1.32xlarge)"]) == (pp > 1)
    assert "fits" in out and "does NOT fit" not in out.split("largest stage")[1].splitlines()[0]


def test_unconfirmed_figures_say_so():
    for row in table_rows(PLAN).values():
        assert row["May 2025 page"].endswith("(unverified)")


# ---------------------------------------------------------------------------
# The frozen stack
# ---------------------------------------------------------------------------

def pins() -> dict[str, str]:
    """{package: specifier} from the constraints file (comments and blanks skipped)."""
    out = {}
    with open(CONSTRAINTS) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, spec = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", line).groups()
                out[name.lower()] = spec
    return out


def test_the_constraints_file_pins_the_frozen_stack():
    from packaging.specifiers import SpecifierSet
    p = pins()
    assert set(p) == {"torch", "torch-xla", "torch-neuronx", "neuronx-cc"}
    for name in ("torch", "torch-xla"):
        spec = SpecifierSet(p[name])
        assert all(v in spec for v in ("2.9.0", "2.9.1")), name
        assert not any(v in spec for v in ("2.8.0", "2.10.0")), name
    assert "2.9.0.2.13.1" in SpecifierSet(p["torch-neuronx"])       # Neuron 2.29's torch-neuronx 2.9.0.2.13.*
    assert "2.9.0.2.15.32035" not in SpecifierSet(p["torch-neuronx"])  # Neuron 2.31's: no training support
    assert p["neuronx-cc"] == "==2.24.5133.0"


def test_the_install_section_uses_the_constraints_file():
    install = section("2. Installing torch-neuronx 2.9")
    assert "pip install -c constraints/trn1-neuron-2.29.txt" in install
    assert "2.30" in install and "TorchNeuron" in install
