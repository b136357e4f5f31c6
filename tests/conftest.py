"""Shared fixtures: the repo root on sys.path, one warm data cache for the session,
and `run_layouts`, which trains several layouts in one set of spawned gloo workers.

The tests stand in folders that mirror nanohlat's floors (core/, beyond/, tools/,
plan/, run/, commands/, serving/, classroom/, and repo/ for the repository's own
checks). Every folder is put on sys.path here, so a test module imports the
shared helpers (dist_utils beside this file; hostile, plan_utils, moe_utils, plants
in their folders) and another folder's test module by name, whichever files pytest
was asked to run; so no two files under tests/ share a name (tests/repo/test_structure.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for _folder in sorted(os.path.join(TESTS, d) for d in os.listdir(TESTS) if not d.startswith((".", "_"))
                      and os.path.isdir(os.path.join(TESTS, d))) + [TESTS, ROOT]:
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

# The helper modules beside the tests (not test_*.py) hold asserts too: pytest rewrites theirs as it
# does a test module's, so that a failure inside one shows its values. (Before they are imported.)
pytest.register_assert_rewrite("hostile", "plan_utils")



@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """Tokenizer + token shards of the built-in corpus at tiny's vocab, built once."""
    from nanohlat.run import data
    path = str(tmp_path_factory.mktemp("cache"))
    data.prepare_data("", "", 512, path, log=lambda *a: None)
    return path


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]
