"""Shared fixtures: the repo root on sys.path, one warm data cache for the session,
and `run_layouts`, which trains several layouts in one set of spawned gloo workers."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)



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
