"""What the tests of a mixture of experts (nanohlat/beyond/moe.py) share: a routing case and experts
in fp64, the moe preset's config, and a run of the moe preset in this process (test_moe_router_and_dispatch.py,
test_moe_training_and_expert_parallel.py, test_moe_with_other_layouts.py, test_moe_bias.py)."""

from __future__ import annotations

import torch

from conftest import read_metrics
from nanohlat import recipe


def _routing_case(N=64, C=16, E=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, C, generator=g, dtype=dtype), torch.randn(E, C, generator=g, dtype=dtype)


def _experts(E=4, C=16, Fd=24, seed=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=dtype) * 0.3 for s in ((E, Fd, C), (E, Fd, C), (E, C, Fd)))


MOE_CFG = recipe.PRESETS["moe"][0]


def _train_here(argv):
    import train
    from nanohlat.run import preflight
    model_cfg, tcfg = recipe.parse_args(argv)
    return train.train(*preflight.inputs(model_cfg, tcfg))


def _flags(cache_dir, out, *extra):
    return ["--preset", "moe", "--steps", "10", "--device", "cpu", "--cache-dir", cache_dir, "--out-dir", str(out), "--no-progress",
            "--eval-every", "0", "--threads", "1", *[str(e) for e in extra]]


def _losses(out):
    return {m["step"]: m["loss"] for m in read_metrics(str(out))}
