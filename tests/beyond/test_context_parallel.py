"""Context-parallel attention (nanohlat/beyond/context_parallel.py) equals full causal attention.

Each gloo worker holds the same full q, k, v (before rotary) and a random upstream
gradient; the reference is one process's causal attention over the whole sequence,
its output and the gradients of q, k, v. Each rank then takes its zigzag tokens,
rotates them with their global positions, runs a cp algorithm and backward, and
its output and gradients must equal the reference's rows for its tokens.

Error figure: max |cp - reference| / max |reference|, per tensor (out, dq, dk, dv).
fp32: <= 1e-6. bf16 (inputs rounded to bf16, the reference in fp32 on the same
rounded values): <= BF16_TOL; measured at cp 2 and 4: out 4e-3, gradients up to
1.2e-2, where one process's bf16 attention is off by as much (the "dense bf16" row
the test prints), and at cp 4 not more than 1.5x (+1e-3) what it is at cp 2.
The negative controls (a ring that keeps a stale K/V block; rotary without each
token's global offset) must be off by far more than either tolerance.

Each algorithm runs its (query chunk, key chunk) pairs through the fused CPU kernel;
the same in fp32 matmuls (context_parallel.FUSED off: what runs where torch has no
kernel returning the log-sum-exp; 3 query rows at a time) must agree as closely. And the (query, key) pairs
each rank computes, counted at every call of the pairs' arithmetic (`_attend`: a full
pair all its tq x tk, a causal one tq(tq+1)/2, per sequence and head), are the causal
pairs of its tokens, the plan's "zigzag pairs" (plan/context.py): nothing the
mask hides is computed.
"""

from __future__ import annotations

import json
import os

import pytest

from dist_utils import spawn_workers

FP32_TOL = 1e-6
BF16_TOL = 1.6e-2
CAUGHT = 1e-2           # a negative control must be off by at least this much
B, H, KV, D = 2, 8, 4, 8


def _error(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _worker(rank: int, world: int, out_dir: str, algorithms: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from nanohlat import comm
    from nanohlat.beyond import context_parallel as cpl
    from nanohlat.comm import Group
    from nanohlat.model import apply_rotary, rotary_tables
    from nanohlat.plan import context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = Group("cp", list(range(world)), rank, dist.new_group(list(range(world))))
    T = 32                                # the same sequence at every cp: 32 / (2 cp) tokens a chunk
    g = torch.Generator().manual_seed(0)  # the same tensors on every rank
    full = {n: torch.randn(B, h, T, D, generator=g) for n, h in (("q", H), ("k", KV), ("v", KV))}
    upstream = torch.randn(B, H, T, D, generator=g)
    cos, sin = rotary_tables(D, T, 1e4)
    table = cpl.zigzag_positions(T, world)
    mine = table[rank]

    def reference(dtype):
        x = {n: t.to(dtype).double().float().requires_grad_() for n, t in full.items()}
        q, k = apply_rotary(x["q"], cos, sin), apply_rotary(x["k"], cos, sin)
        rep = H // KV
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), x["v"].repeat_interleave(rep, 1), is_causal=True)
        y.backward(upstream)
        return {"out": y.detach()[:, :, mine], **{"d" + n: x[n].grad[:, :, mine] for n in x}}

    def cp_run(algorithm, dtype, rotary_positions=None):
        x = {n: t[:, :, mine].to(dtype).requires_grad_() for n, t in full.items()}
        pos = mine if rotary_positions is None else rotary_positions
        q, k = apply_rotary(x["q"], cos[pos], sin[pos]), apply_rotary(x["k"], cos[pos], sin[pos])
        y = cpl.attention(q, k, x["v"], group, table, algorithm)
        y.backward(upstream[:, :, mine].to(dtype))
        return {"out": y.detach(), **{"d" + n: x[n].grad for n in x}}

    def errors(got, want):
        return {n: _error(got[n], want[n]) for n in want}

    pairs = {}
    attend = cpl._attend

    def counted(q, k, v, causal):   # the pairs each call computes, over its sequences and heads
        B_, H_, tq, tk = *q.shape[:3], k.shape[2]
        pairs[current] = pairs.get(current, 0) + B_ * H_ * (tq * (tq + 1) // 2 if causal else tq * tk)
        return attend(q, k, v, causal)

    results = {}
    ref32, ref16 = reference(torch.float32), reference(torch.bfloat16)
    for algorithm in algorithms:
        current, cpl._attend = algorithm, counted
        results[f"{algorithm} fp32"] = errors(cp_run(algorithm, torch.float32), ref32)
        cpl._attend = attend
        results[f"{algorithm} bf16"] = errors(cp_run(algorithm, torch.bfloat16), ref16)
        cpl.FUSED, cpl.ROWS = False, 3     # (3 query rows at a time: chunks of 8 or 4 rows split unevenly)
        results[f"{algorithm} fp32 unfused"] = errors(cp_run(algorithm, torch.float32), ref32)
        results[f"{algorithm} bf16 unfused"] = errors(cp_run(algorithm, torch.bfloat16), ref16)
        cpl.FUSED, cpl.ROWS = True, 1024
        # negative control: rotary with local positions 0..t-1, the offset of the tokens forgotten
        results[f"{algorithm} wrong offset"] = errors(
            cp_run(algorithm, torch.float32, torch.arange(len(mine))), ref32)
    # dense bf16 attention against the same fp32 reference: what bf16 costs without cp
    x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in full.items()}
    q, k = apply_rotary(x["q"], cos, sin), apply_rotary(x["k"], cos, sin)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // KV, 1), x["v"].repeat_interleave(H // KV, 1), is_causal=True)
    dense.backward(upstream.to(torch.bfloat16))
    results["dense bf16"] = errors({"out": dense.detach()[:, :, mine],
                                    **{"d" + n: x[n].grad[:, :, mine] for n in x}}, ref16)
    if "ring" in algorithms:
        # negative control: a ring whose shift hands back the block it was given (a stale K/V block)
        real = comm.start_ring_shift
        comm.start_ring_shift = lambda x, group, step=1, what=None: (x.clone(), [])
        try:
            results["ring stale block"] = errors(cp_run("ring", torch.float32), ref32)
        finally:
            comm.start_ring_shift = real
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    with open(os.path.join(out_dir, f"pairs{rank}.json"), "w") as f:
        json.dump({"computed": pairs, "causal": context.attention_pairs(T, world, "zigzag")[rank] * H}, f)
    dist.destroy_process_group()


def _run(tmp_path, world, algorithms=("allgather", "ring", "ulysses")) -> dict:
    """{case: {tensor: the worst error over the ranks}}; and every rank's pairs computed by each algorithm
    equal to its causal pairs, the plan's."""
    spawn_workers(_worker, world, (str(tmp_path), list(algorithms)), str(tmp_path / "err"))
    worst = {}
    for r in range(world):
        with open(tmp_path / f"pairs{r}.json") as f:
            pairs = json.load(f)
        assert pairs["computed"] == dict.fromkeys(algorithms, B * pairs["causal"]), (r, pairs)
        with open(tmp_path / f"rank{r}.json") as f:
            for case, errs in json.load(f).items():
                for n, e in errs.items():
                    worst.setdefault(case, {})[n] = max(e, worst.get(case, {}).get(n, 0.0))
    print(json.dumps(worst, indent=1))
    return worst


def _check(worst: dict, algorithms) -> None:
    for a in algorithms:
        for kernel in ("", " unfused"):
            for n, e in worst[f"{a} fp32{kernel}"].items():
                assert e <= FP32_TOL, f"{a} fp32{kernel} {n}: {e:.2e} > {FP32_TOL}"
            for n, e in worst[f"{a} bf16{kernel}"].items():
                assert e <= BF16_TOL, f"{a} bf16{kernel} {n}: {e:.2e} > {BF16_TOL}"
        assert worst[f"{a} wrong offset"]["out"] > CAUGHT, f"{a}: a wrong rotary offset went unseen"
    if "ring" in algorithms:
        assert worst["ring stale block"]["out"] > CAUGHT, "a stale K/V block in the ring went unseen"


def test_cp2_every_algorithm_equals_full_attention(tmp_path):
    worst = _run(tmp_path, 2)
    _check(worst, ("allgather", "ring", "ulysses"))


@pytest.mark.slow
def test_cp4_every_algorithm_equals_full_attention_and_bf16_does_not_grow(tmp_path):
    worst4 = _run(tmp_path / "cp4", 4)
    _check(worst4, ("allgather", "ring", "ulysses"))
    worst2 = _run(tmp_path / "cp2", 2)
    for a in ("allgather", "ring", "ulysses"):
        for n, e in worst4[f"{a} bf16"].items():
            assert e <= 1.5 * worst2[f"{a} bf16"][n] + 1e-3, \
                f"{a} bf16 {n}: {e:.2e} at cp 4 against {worst2[f'{a} bf16'][n]:.2e} at cp 2"


def test_zigzag_split_shifts_first_and_keeps_positions():
    import torch

    from nanohlat.beyond import context_parallel as cpl
    assert cpl.zigzag_positions(8, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    tokens = torch.arange(9).view(1, 9) * 10          # token value = 10 x position
    for rank in range(2):
        inputs, targets, positions = cpl.split_sequence(tokens, 2, rank)
        assert inputs.tolist() == [[10 * p for p in positions.tolist()]]
        assert targets.tolist() == [[10 * (p + 1) for p in positions.tolist()]]   # the next token, always
    # every rank has the same causal work (sum of position + 1); a contiguous split does not
    work = lambda table: [int((row + 1).sum()) for row in table]
    assert len(set(work(cpl.zigzag_positions(32, 4)))) == 1
    assert work(cpl.contiguous_positions(32, 4)) == [36, 100, 164, 228]
    with pytest.raises(ValueError, match="multiple of 8"):
        cpl.zigzag_positions(12, 4)


def test_ulysses_refuses_heads_not_divisible_by_cp():
    import torch

    from nanohlat.beyond import context_parallel as cpl
    from nanohlat.comm import Group
    group = Group("cp", [0, 1, 2], 0)
    q, k = torch.zeros(1, 6, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"kv heads \(2\) .* cp 3"):
        cpl.ulysses_attention(q, k, k, group, cpl.zigzag_positions(12, 3))
