"""Replicas stay bitwise identical, and --check-replicas notices when they do not.

Every rank that holds a copy of a parameter (dp replicas, with or without
ZeRO-1; cp ranks, which hold the same weights and other tokens; tp ranks for
the replicated RMSNorm gains and, with more tp ranks than kv heads, for the kv
heads they share) updates its own copy. The
copies stay equal only if every rank computes the same update bit for bit:
the same reduced gradients, the same grad norm and, in bf16-sr, the same
stochastic-rounding noise for the same element (precision.py). Ten steps in
each precision and layout, then every pair of copies is compared exactly: a
rank-dependent anything (as the rank-seeded noise once was) fails here.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_layouts

BASE = ["--preset", "tiny", "--steps", "10", "--eval-every", "0", "--batch-size", "4", "--seq-len", "16",
        "--n-layers", "2", "--warmup-steps", "2", "--lr", "3e-3"]
PRECISIONS = ("fp32", "bf16", "bf16-sr", "bf16-mixed", "bf16-sr+moments")   # +moments: --moments bf16 too


def precision_flags(precision: str) -> list[str]:
    name, _, moments = precision.partition("+")
    return ["--precision", name] + (["--moments", "bf16"] if moments else [])
WORLD2 = {"dp2": ["--dp", "2"], "dp2_zero1": ["--dp", "2", "--zero1", "--bucket-mb", "0.01"],
          "tp2_sp": ["--tp", "2", "--sequence-parallel"],
          # the cp ranks hold the same weights (and other tokens): copies like dp's
          "cp2_ring": ["--cp", "2", "--cp-attention", "ring"]}
WORLD4 = {"tp2_pp2_sp": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--microbatches", "2"],
          # 2 kv heads on 4 tp ranks: ranks [0 1] and [2 3] each hold copies of one kv head
          "tp4_kv2_sp": ["--tp", "4", "--n-kv-heads", "2", "--sequence-parallel"],
          # ZeRO-1's shards over the dp x cp ranks; Ulysses' all-to-alls in the forward and backward
          "cp2_dp2_zero1_ulysses": ["--cp", "2", "--cp-attention", "ulysses", "--dp", "2", "--zero1",
                                    "--bucket-mb", "0.01"]}


def _skip_cpu_peak() -> None:
    """The MFU's CPU matmul-rate measurement takes seconds per run and is not under test."""
    from nanohlat.tools import metrics
    metrics.measure_cpu_peak = lambda *args, **kwargs: 1e12


def _dump_replicas(rank: int) -> None:
    """Worker setup: after each run, save this rank's parameters and its mesh
    coordinates to <out-dir>/replicas/rank<r>.pt."""
    import train
    from nanohlat import optim
    _skip_cpu_peak()
    latest = {}
    real_init, real_train = optim.FlatAdamW.__init__, train.train

    def init(self, model, mesh, *args, **kwargs):
        real_init(self, model, mesh, *args, **kwargs)
        latest.update(model=model, mesh=mesh)

    def train_and_dump(model_cfg, tcfg, *args, **kwargs):
        out = real_train(model_cfg, tcfg, *args, **kwargs)
        model, mesh = latest["model"], latest["mesh"]
        params = {}
        for name, p in model.named_parameters():
            chunks = p.shard.parts
            params[name] = (p.detach().clone(), mesh.tp_rank * chunks // mesh.tp)   # (copy, which slice)
        os.makedirs(os.path.join(tcfg.out_dir, "replicas"), exist_ok=True)
        torch.save({"dp": mesh.dp_rank, "pp": mesh.pp_rank, "tp": mesh.tp_rank, "params": params},
                   os.path.join(tcfg.out_dir, "replicas", f"rank{rank}.pt"))
        return out
    optim.FlatAdamW.__init__ = init
    train.train = train_and_dump


@pytest.fixture(scope="module")
def replica_runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    outs = {}
    for world, layouts in ((2, WORLD2), (4, WORLD4)):
        runs = []
        for name, extra in layouts.items():
            for precision in PRECISIONS:
                out = root / f"{name}_{precision}"
                outs[name, precision] = out
                runs.append(BASE + extra + precision_flags(precision) + ["--cache-dir", cache_dir,
                                                                         "--out-dir", str(out)])
        run_layouts(world, runs, str(root / f"errors{world}"), setup=_dump_replicas)
    return outs


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", list(WORLD2) + list(WORLD4))
@pytest.mark.slow
def test_every_replica_is_bitwise_identical(layout, precision, replica_runs):
    folder = replica_runs[layout, precision] / "replicas"
    ranks = [torch.load(folder / n, weights_only=True) for n in sorted(os.listdir(folder))]
    compared = 0
    for a in ranks:
        for b in ranks:
            if a is b or a["pp"] != b["pp"]:   # (cp ranks: same dp and tp, so compared below)
                continue
            for name, (wa, slice_a) in a["params"].items():
                wb, slice_b = b["params"][name]
                same_copy = (a["tp"] == b["tp"]) if a["dp"] != b["dp"] else (slice_a == slice_b)
                if same_copy:
                    assert torch.equal(wa.view(-1).view(torch.int16 if wa.element_size() == 2 else torch.int32),
                                       wb.view(-1).view(torch.int16 if wb.element_size() == 2 else torch.int32)), \
                        f"{name} differs between ranks {a['dp'], a['pp'], a['tp']} and {b['dp'], b['pp'], b['tp']}"
                    compared += 1
    assert compared > 0
    # and training happened: the weights moved from their initial values
    first = ranks[0]["params"]
    assert any(not torch.equal(w, torch.ones_like(w)) for n, (w, _) in first.items() if "norm" in n)


def _plant_divergence(rank: int) -> None:
    """Worker setup: after its 3rd optimizer step, rank 1 flips a mantissa bit (8 bf16 ulps,
    more than one step can heal) of the first element of one parameter: a matrix (with --dp 2) or
    an RMSNorm gain (with --tp 2)."""
    from nanohlat import optim
    _skip_cpu_peak()
    real_write_back, calls = optim.FlatAdamW.write_back, []

    @torch.no_grad()
    def write_back(self):   # the optimizer step's last phase
        out = real_write_back(self)
        calls.append(1)
        if len(calls) == 3 and rank == 1:
            group = next(g for g in self.groups if g.tp_replicated == (self.mesh.tp > 1))
            # the weight, and the master copy (what the next steps update) where it is a separate one
            for t in [group.params[0]] + ([] if group.master_is_params else [group.master]):
                bits = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
                bits[0] ^= 8
        return out
    optim.FlatAdamW.write_back = write_back


@pytest.mark.parametrize("layout, kind, param", [(["--dp", "2"], "dp", "embed.weight"),
                                                 (["--tp", "2"], "tp", "layers.0.attn_norm.weight")])
def test_check_replicas_stops_a_run_whose_replicas_diverged(layout, kind, param, cache_dir, tmp_path):
    """One flipped bit on rank 1 after step 3; --check-replicas 2 finds it after step 4
    and every rank stops with the same one-line UserError (train.py: exit code 2)."""
    argv = BASE + layout + ["--precision", "bf16-sr", "--check-replicas", "2", "--cache-dir", cache_dir,
                            "--out-dir", str(tmp_path / "run")]
    with pytest.raises(AssertionError):
        run_layouts(2, [argv], str(tmp_path / "errors"), setup=_plant_divergence)
    errors = [open(tmp_path / "errors" / n).read() for n in sorted(os.listdir(tmp_path / "errors"))]
    assert len(errors) == 2, "both ranks must stop"
    for text in errors:
        assert text.strip().splitlines()[-1] == (
            f"nanohlat.config.UserError: --check-replicas: after step 4, parameter {param} differs between "
            f"its {kind} replicas on ranks [0, 1]; replicas must be bitwise identical, so this is a bug or a "
            f"faulty device: resume from an earlier checkpoint on other hardware or report it")
