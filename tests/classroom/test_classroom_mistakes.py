"""The classroom checks against planted student mistakes: neither vacuous nor over-fitted.

For every exercise, several realistic wrong implementations (the kind a
student writes: a wrong sign or scale, an off-by-one, the wrong group, bf16
where fp32 belongs, the right values through a dearer collective, code that
only breaks on large logits or on an odd NaN) are planted in the exercise's
region, and its check must FAIL them, with a verdict that names the case that
caught the mistake. For every chapter, correct rewrites that differ from the
reference must PASS. The reference itself, in the same copy, must pass.

How a mistake is planted: the test writes a copy of the repository, then one
subprocess (its own nanohlat, from the copy) takes the plants one at a time:
it writes the planted file, imports nanohlat afresh (no bytecode cache), runs
that exercise's checks (`checks.run`, what `python -m nanohlat.classroom
check ID` runs, distributed checks with their gloo workers) and puts the file
back. One process for all of them keeps torch's import and the workers' fork
server to one start each.

All of them take minutes. To plant one chapter's (or some exercises') only, name
them in NANOHLAT_PLANTS: `NANOHLAT_PLANTS=10 python -m pytest
tests/classroom/test_classroom_mistakes.py` (chapter 10), or `NANOHLAT_PLANTS="10a 10b"`;
the count that docs/teaching.md states is still held to every plant.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN = re.compile(r"^(\s*)# exercise (\d+[a-z]): begin\s*$")
END = re.compile(r"^\s*# exercise (\d+[a-z]): end\s*$")


@dataclass
class Plant:
    ex: str                      # the exercise whose check runs
    what: str                    # the mistake (or the rewrite), in one line
    edits: list                  # ("body", k, code): region k of ex becomes `code`; ("sub", old, new) inside ex's regions
    catches: str = ""            # a mistake: words of the verdict naming the case that caught it
    right: bool = False          # a correct rewrite: must pass
    extra: dict = field(default_factory=dict)


def body(k: int, code: str):
    return ("body", k, textwrap.dedent(code).strip("\n"))


def reference(ex: str, k: int = 0) -> str:
    """Region k of exercise ex as the reference has it (dedented): the code a
    mistake below edits, read from the source so that it cannot go stale."""
    from nanohlat.classroom import kit
    path, begin, end, _ = kit.find_regions(ROOT)[ex][k]
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return textwrap.dedent("\n".join(f.read().splitlines()[begin + 1:end])) + "\n"


def sub(old: str, new: str):
    return ("sub", old, new)


def wrong(ex, what, catches, *edits):
    return Plant(ex, what, list(edits), catches=catches)


def right(ex, what, *edits):
    return Plant(ex, what, list(edits), right=True)


RMS = "h = x.float()\n{}\nreturn self.weight * h.to(x.dtype)"
CE_MAX = "m = comm.all_gather(local_max.unsqueeze(0), group, dim=0).amax(dim=0)"
CE_SUM = "sum_exp = reduce_sum(torch.exp(logits - m.unsqueeze(-1)).sum(dim=-1), group)"
CE_MASK = 'logits = logits.masked_fill(ids >= vocab_size, float("-inf"))'
KV = """
cache_k, cache_v = self.cache[i]
rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
cache_k[rows, :, self.positions] = k.transpose(1, 2)
cache_v[rows, :, self.positions] = v.transpose(1, 2)
S = self.columns
mask = torch.arange(S, device=self.positions.device) <= self.positions.unsqueeze(-1)
return cache_k[:, :, :S], cache_v[:, :, :S], mask.unsqueeze(1)
"""
ONE_F_ONE_B = reference("5a")
SR = """
x = x.float().contiguous()
bits = x.view(torch.int32)
if noise is None:
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
rounded = (bits + noise) & -65536
out = rounded.view(torch.float32).to(torch.bfloat16)
return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)
"""
RESHARD = """
dst, cov = out, covered
if tp_dim >= 0:
    size = full_shape[tp_dim] // parts
    dst, cov = out.narrow(tp_dim, part * size, size), covered.narrow(tp_dim, part * size, size)
"""
MESH = reference("6b")
ZERO_RS = """
rows = flat.view(group.size, -1)
shard = torch.empty(rows.shape[1], dtype=flat.dtype, device=flat.device)
for a, b in bucket_ranges(rows.shape[1], bucket_elems // group.size):
    piece = rows[:, a:b].contiguous().view(-1)
    shard[a:b] = comm.reduce_scatter(piece, group)
return shard
"""
ZERO_AG = reference("3c")
WRONG_COMM = "right values, but"
WROTE_INTO = "right values, but it wrote into"
ZERO2_RS = "s.grad[a:b].add_(comm.reduce_scatter(piece, self.group, what=(s.grad, k)))"
RING = reference("11c")
RING_PAIRS = """
    for a, b, causal in _pairs(q_pos, positions[r]):
        g_q, g_k, g_v = _attend_grads(qc[a], dc[a], oc[a], lc[a], kc[b], vc[b], causal)
        dq[a] += g_q
        dk[b] += g_k
        dv[b] += g_v
"""
RING_RETURN = "return torch.cat(dq, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None"


def ring(head: str, tail: str, ret: str = RING_RETURN):
    """11c's region as `head` (ending inside a loop over the blocks, r the block's rank), the
    reference's arithmetic for each pair of block r, `tail` (back in the loop), then `ret`."""
    head = head.rstrip("\n")
    last = head.splitlines()[-1]
    code = textwrap.dedent(head + "\n" + last[:len(last) - len(last.lstrip())] + "<pairs>" + tail.rstrip())
    at = code.index("<pairs>")
    indent = code[code.rindex("\n", 0, at) + 1:at]
    pairs = textwrap.indent(textwrap.dedent(RING_PAIRS).strip("\n"), indent)
    return body(0, code.replace(indent + "<pairs>", pairs) + "\n" + ret)

PLANTS = [
    # ---- 1a RMSNorm -------------------------------------------------------------------------------
    wrong("1a", "forgets eps: a near-zero vector becomes a unit vector", "near-zero vector",
          body(0, RMS.format("h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))"))),
    wrong("1a", "adds eps outside the square root", "near-zero vector",
          body(0, RMS.format("h = h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)"))),
    wrong("1a", "normalises in bf16 (no .float()): mean of squares and rsqrt in bf16", "1.5 bf16 steps",
          body(0, "h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\nreturn self.weight * h")),
    wrong("1a", "takes the sum of squares, not their mean", "fp32 input",
          body(0, RMS.format("h = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + self.eps)"))),
    wrong("1a", "returns fp32 for a bf16 input (the weight times the fp32 h)", "keeps the input's dtype",
          body(0, "h = x.float()\nh = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)\n"
                  "return self.weight * h")),
    wrong("1a", "normalises in place (h *= ...): x.float() of an fp32 x is x itself, the residual stream changed",
          "fp32 input: RMSNorm: " + WROTE_INTO + " its input x",
          body(0, RMS.format("h *= torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)"))),
    right("1a", "divides by sqrt instead of multiplying by rsqrt, weight applied in fp32, rounded once",
          body(0, """
              h = x.float()
              h = h / torch.sqrt(torch.mean(h * h, dim=-1, keepdim=True) + self.eps)
              return (self.weight.float() * h).to(x.dtype)""")),
    # ---- 1b rotary --------------------------------------------------------------------------------
    wrong("1b", "rotates the other way: [x2, -x1] instead of [-x2, x1]", "positions 0..11",
          body(0, "x1, x2 = x.chunk(2, dim=-1)\nrotated = torch.cat([x2, -x1], dim=-1)\n"
                  "return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)")),
    wrong("1b", "pairs neighbours (x_2i, x_2i+1), GPT-J style, against tables built for rotate-half", "positions 0..11",
          body(0, "x1, x2 = x[..., ::2], x[..., 1::2]\nrotated = torch.stack([-x2, x1], dim=-1).flatten(-2)\n"
                  "return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)")),
    wrong("1b", "swaps cos and sin", "positions 0..11",
          body(0, "x1, x2 = x.chunk(2, dim=-1)\nrotated = torch.cat([-x2, x1], dim=-1)\n"
                  "return x * sin.to(x.dtype) + rotated * cos.to(x.dtype)")),
    wrong("1b", "splits the positions instead of the features (chunk along dim -2)", "positions 0..11",
          body(0, "x1, x2 = x.chunk(2, dim=-2)\nrotated = torch.cat([-x2, x1], dim=-2)\n"
                  "return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)")),
    right("1b", "slices the halves by index instead of chunk",
          body(0, """
              half = x.shape[-1] // 2
              rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
              return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)""")),
    # ---- 1c KV cache ------------------------------------------------------------------------------
    wrong("1c", "returns no mask: a chunk's tokens see their own future", "fed with the KV cache",
          body(0, KV.replace("mask.unsqueeze(1)", "None"))),
    wrong("1c", "mask with < instead of <=: a token cannot see itself", "fed with the KV cache",
          body(0, KV.replace(") <= self.positions", ") < self.positions"))),
    wrong("1c", "writes the new keys at columns 0..T-1, ignoring their positions", "fed with the KV cache",
          body(0, KV.replace("cache_k[rows, :, self.positions] = k.transpose(1, 2)", "cache_k[:, :, :k.shape[2]] = k")
                    .replace("cache_v[rows, :, self.positions] = v.transpose(1, 2)", "cache_v[:, :, :v.shape[2]] = v"))),
    wrong("1c", "one mask for every row, from row 0's positions", "ragged rows",
          body(0, KV.replace("mask = torch.arange(S, device=self.positions.device) <= self.positions.unsqueeze(-1)",
                             "mask = (torch.arange(S) <= self.positions[0].unsqueeze(-1)).expand(k.shape[0], -1, -1)"))),
    right("1c", "writes row by row, builds the mask the other way round",
          body(0, """
              cache_k, cache_v = self.cache[i]
              for row in range(k.shape[0]):
                  cache_k[row][:, self.positions[row]] = k[row]
                  cache_v[row][:, self.positions[row]] = v[row]
              S = self.columns
              mask = self.positions[:, :, None] >= torch.arange(S, device=k.device)
              return cache_k[:, :, :S], cache_v[:, :, :S], mask[:, None]""")),
    # ---- 3a bucketed all-reduce ---------------------------------------------------------------------
    wrong("3a", "all-reduces a copy of each bucket and never writes the sum back", "all_reduce_buckets",
          body(0, "for a, b in bucket_ranges(flat.numel(), bucket_elems):\n"
                  "    comm.all_reduce(flat[a:b].clone(), group)\nreturn flat")),
    wrong("3a", "one all-reduce of the whole buffer: the buckets ignored", "made 1 collective call",
          body(0, "return comm.all_reduce(flat, group, inplace=True)")),
    wrong("3a", "torch.distributed's all-reduce without its group: the default (world) group", "default (world)",
          body(0, "import torch.distributed as dist\nfor a, b in bucket_ranges(flat.numel(), bucket_elems):\n"
                  "    dist.all_reduce(flat[a:b])\nreturn flat")),
    wrong("3a", "averages instead of summing", "all_reduce_buckets",
          body(0, "for a, b in bucket_ranges(flat.numel(), bucket_elems):\n"
                  "    flat[a:b] = comm.all_reduce(flat[a:b].contiguous(), group) / group.size\nreturn flat")),
    wrong("3a", "off by one: the last element is never reduced", "all_reduce_buckets",
          body(0, "for a, b in bucket_ranges(flat.numel() - 1, bucket_elems):\n"
                  "    flat[a:b] = comm.all_reduce(flat[a:b].contiguous(), group)\nreturn flat")),
    right("3a", "all-reduces each bucket's view in place, nothing to write back",
          body(0, "for a, b in bucket_ranges(flat.numel(), bucket_elems):\n"
                  "    comm.all_reduce(flat[a:b], group, inplace=True)\nreturn flat")),
    # ---- 3b ZeRO-1 reduce-scatter -------------------------------------------------------------------
    wrong("3b", "cuts each bucket as one contiguous piece of the flat buffer, not columns of every row",
          "reduce_scatter_buckets",
          body(0, ZERO_RS.replace("piece = rows[:, a:b].contiguous().view(-1)",
                                  "piece = flat[a * group.size:b * group.size]"))),
    wrong("3b", "all-reduces each bucket and keeps its own row: right values, twice the bytes", WRONG_COMM,
          body(0, """
              rows = flat.view(group.size, -1)
              shard = torch.empty(rows.shape[1], dtype=flat.dtype, device=flat.device)
              for a, b in bucket_ranges(rows.shape[1], bucket_elems // group.size):
                  summed = comm.all_reduce(rows[:, a:b].contiguous(), group)
                  shard[a:b] = summed[group.rank]
              return shard""")),
    wrong("3b", "buckets of bucket_elems columns (not bucket_elems // dp): dp times too large",
          "collective call(s)", body(0, ZERO_RS.replace("bucket_elems // group.size", "bucket_elems"))),
    wrong("3b", "one reduce-scatter of the whole buffer: the buckets ignored", "collective call(s)",
          body(0, "return comm.reduce_scatter(flat, group)")),
    wrong("3b", "torch.distributed's reduce-scatter without its group", "default (world)",
          body(0, ZERO_RS.replace("shard[a:b] = comm.reduce_scatter(piece, group)",
                                  "torch.distributed.reduce_scatter_tensor(shard[a:b], piece)"))),
    right("3b", "gathers each rank's columns with torch.cat instead of a strided view",
          body(0, """
              size = flat.numel() // group.size
              shard = torch.empty(size, dtype=flat.dtype, device=flat.device)
              for a, b in bucket_ranges(size, bucket_elems // group.size):
                  piece = torch.cat([flat[r * size + a:r * size + b] for r in range(group.size)])
                  shard[a:b] = comm.reduce_scatter(piece, group)
              return shard""")),
    # ---- 3c ZeRO-1 all-gather -----------------------------------------------------------------------
    wrong("3c", "concatenates the gathered buckets in call order: ranks' elements interleaved", "all_gather_buckets",
          body(0, "return torch.cat([comm.all_gather(shard[a:b].contiguous(), group)\n"
                  "                  for a, b in bucket_ranges(shard.numel(), bucket_elems // group.size)])")),
    wrong("3c", "all-reduces a zero buffer holding its own shard: right values, twice the bytes", WRONG_COMM,
          body(0, """
              full = torch.zeros(group.size, shard.numel(), dtype=shard.dtype, device=shard.device)
              full[group.rank] = shard
              for a, b in bucket_ranges(shard.numel(), bucket_elems // group.size):
                  full[:, a:b] = comm.all_reduce(full[:, a:b].contiguous(), group)
              return full.view(-1)""")),
    wrong("3c", "one all-gather of the whole shard: the buckets ignored", "collective call(s)",
          body(0, "return comm.all_gather(shard, group)")),
    wrong("3c", "buckets of bucket_elems elements of each shard (not bucket_elems // dp)", "collective call(s)",
          body(0, ZERO_AG.replace("bucket_elems // group.size", "bucket_elems"))),
    right("3c", "gathers each bucket as a (dp, columns) block with dim=1",
          body(0, """
              full = torch.empty(group.size, shard.numel(), dtype=shard.dtype, device=shard.device)
              for a, b in bucket_ranges(shard.numel(), bucket_elems // group.size):
                  full[:, a:b] = comm.all_gather(shard[a:b].view(1, -1).contiguous(), group, dim=0)
              return full.reshape(-1)""")),
    # ---- 3d ZeRO-2 bucket (regions: 0 reduce_bucket, 1 finish) --------------------------------------
    wrong("3d", "assigns the reduce-scattered columns instead of adding them: micro-batch 0's sum lost",
          "dp=3, overlap off, n=10", sub(ZERO2_RS, "s.grad[a:b] = comm.reduce_scatter(piece, self.group)")),
    wrong("3d", "all-reduces the bucket and adds its own row: right values, twice the bytes", WRONG_COMM,
          sub(ZERO2_RS, "s.grad[a:b].add_(comm.all_reduce(piece, self.group).view(self.group.size, -1)"
                        "[self.group.rank])")),
    wrong("3d", "torch.distributed's reduce-scatter without its group", "default (world)",
          sub(ZERO2_RS, "out = torch.empty(b - a)\n            torch.distributed.reduce_scatter_tensor(out, piece)\n"
                        "            s.grad[a:b].add_(out)")),
    wrong("3d", "overlap: never waits at the micro-batch's last bucket (in flight into the next)", "still in flight",
          sub("if len(s.flight) == len(s.watch.buckets):", "if False:")),
    wrong("3d", "overlap: waits once all but one bucket are in flight (off by one)",
          "bucket 1's reduce_scatter was started and waited before reduce_bucket returned",
          sub("if len(s.flight) == len(s.watch.buckets):", "if len(s.flight) == len(s.watch.buckets) - 1:")),
    wrong("3d", "keeps the staging (reads it instead of popping it)", "staging is still kept",
          sub("piece, (a, b) = s.staged.pop(k), s.watch.buckets[k][0]",
              "piece, (a, b) = s.staged[k], s.watch.buckets[k][0]")),
    wrong("3d", "finish waits for the reduce-scatter but never adds its columns", "dp=3, overlap on, n=10",
          body(1, "if k in s.flight:\n    work, out, _ = s.flight.pop(k)\n    work.wait()")),
    wrong("3d", "ignores --overlap-grad-reduce: reduce-scatters every bucket blocking in the hook",
          "dp=3, overlap on, n=10, bucket_elems=6: bucket 1's reduce_scatter was called blocking",
          body(0, "self.finish(s, k)\npiece, (a, b) = s.staged.pop(k), s.watch.buckets[k][0]\n" + ZERO2_RS)),
    wrong("3d", "overlap: starts each bucket's reduce-scatter, then waits for it at once",
          "dp=3, overlap on, n=10, bucket_elems=6: bucket 1's reduce_scatter was started and waited before",
          sub("s.flight[k] = (comm.start_reduce_scatter(piece, out, self.group, what=(s.grad, k)), out, piece)",
              "s.flight[k] = (comm.start_reduce_scatter(piece, out, self.group, what=(s.grad, k)), out, piece)\n"
              "            self.finish(s, k)")),
    wrong("3d", "ignores --no-overlap-grad-reduce: always starts the reduce-scatter, waits at the last bucket",
          "dp=3, overlap off, n=10, bucket_elems=6: bucket 1's reduce_scatter was still in flight",
          sub("if self.overlap:", "if True:")),
    wrong("3d", "finish adds the columns without waiting for the reduce-scatter", "were never waited",
          body(1, "if k in s.flight:\n    work, out, _ = s.flight.pop(k)\n"
                  "    s.grad[s.watch.buckets[k][0][0]:s.watch.buckets[k][0][1]].add_(out)")),
    wrong("3d", "keeps the full buckets and reduce-scatters them all at the micro-batch's last one (no overlap at all)",
          "reduce_bucket started no collective for bucket 1",
          body(0, """
              piece, (a, b) = s.staged.pop(k), s.watch.buckets[k][0]
              s.full = getattr(s, "full", []) + [(piece, a, b)]
              if len(s.full) == len(s.watch.buckets):
                  for piece, a, b in s.full:
                      s.grad[a:b].add_(comm.reduce_scatter(piece, self.group))
                  s.full = []""")),
    right("3d", "always starts the reduce-scatter with torch.distributed, and without overlap waits at once",
          body(0, """
              self.finish(s, k)
              a, b = s.watch.buckets[k][0]
              piece = s.staged.pop(k)
              out = torch.empty(b - a, dtype=piece.dtype, device=piece.device)
              work = torch.distributed.reduce_scatter_tensor(out, piece, group=self.group.pg, async_op=True)
              s.flight[k] = (work, out, piece)
              if not self.overlap or len(s.flight) == len(s.watch.buckets):
                  for j in list(s.flight):
                      self.finish(s, j)""")),
    # ---- 3e ZeRO-3 gather and free (regions: 0 gather, 1 free) -----------------------------------------
    wrong("3e", "frees by putting an empty tensor in place of the flat buffer: the views keep the bytes",
          "keeps only the shard", body(1, "for s in self.shards:\n    s.flat = s.flat.new_empty(0)\nself.whole = False")),
    wrong("3e", "all-reduces a zero buffer holding its own shard: right values, twice the bytes", WRONG_COMM,
          body(0, """
              for s in self.shards if not self.whole else []:
                  s.flat.untyped_storage().resize_(s.padded * s.flat.element_size())
                  full = torch.zeros(s.padded, dtype=s.flat.dtype)
                  full[s.start:s.stop] = s.param_shard
                  torch.distributed.all_reduce(full, group=(group or self.dp.group).pg)
                  s.fill.copy_(full)
              self.whole = True""")),
    wrong("3e", "gathers even when the unit is already whole", "then gather again (already whole)",
          sub("for s in self.shards if not self.whole else []:", "for s in self.shards:")),
    wrong("3e", "ignores the group it is given (a checkpoint's load gathers on another)", "another group given",
          sub("s.fill.copy_(self.gathered(s, group))", "s.fill.copy_(self.gathered(s))")),
    wrong("3e", "free forgets that the unit is no longer whole: the next gather does nothing", "the first gather",
          body(1, "for s in self.shards:\n    s.flat.untyped_storage().resize_(0)")),
    wrong("3e", "torch.distributed's all-gather without its group", "default (world)",
          sub("s.fill.copy_(self.gathered(s, group))",
              "torch.distributed.all_gather_into_tensor(s.fill, s.param_shard)")),
    right("3e", "gathers through all_gather_buckets itself; frees only a storage that holds bytes",
          body(0, """
              if not self.whole:
                  for s in self.shards:
                      s.flat.untyped_storage().resize_(s.flat.numel() * s.flat.element_size())
                      s.fill.copy_(all_gather_buckets(s.param_shard, group or self.dp.group, self.dp.bucket_elems))
                  self.whole = True"""),
          body(1, """
              for s in self.shards:
                  if s.flat.untyped_storage().nbytes():
                      s.flat.untyped_storage().resize_(0)
              self.whole = False""")),
    right("3e", "writes the gathered shards through s.flat itself, not the alias s.fill (the parameters are "
                "`.data` views with version counters of their own: nothing autograd saved sees the write)",
          sub("s.fill.copy_(self.gathered(s, group))", "s.flat.copy_(self.gathered(s, group))")),
    # ---- 4a conjugate functions (regions: 0 _Copy.fwd 1 _Copy.bwd 2 _Reduce.fwd 3 _Reduce.bwd
    #      4 _GatherSeq.fwd 5 _GatherSeq.bwd 6 _ScatterSeq.fwd 7 _ScatterSeq.bwd) ---------------------
    wrong("4a", "_Copy.backward returns g without the all-reduce", "_Copy (enter, no SP) backward",
          body(1, "return g, None")),
    wrong("4a", "_ScatterSeq.forward as all-reduce + chunk: right values, twice the bytes",
          "_ScatterSeq (leave, SP) forward on rank 0: " + WRONG_COMM,
          body(6, "ctx.group = group\nreturn comm.all_reduce(x, group).chunk(group.size, dim=SEQ_DIM)[group.rank]")),
    wrong("4a", "_Copy.backward all-reduces on the default group (torch.distributed, no group)", "default (world)",
          body(1, "import torch.distributed as dist\ng = g.clone()\ndist.all_reduce(g)\nreturn g, None")),
    wrong("4a", "_Copy.backward as all-gather + sum: right values, (tp-1) x S on the wire where 2 (tp-1)/tp x S suffice",
          "_Copy (enter, no SP) backward on rank 0: " + WRONG_COMM,
          body(1, "return comm.all_gather(g.unsqueeze(0), ctx.group).sum(0), None")),
    wrong("4a", "_GatherSeq.backward as all-reduce + chunk: right values, twice the bytes",
          "_GatherSeq (enter, SP) backward on rank 0: " + WRONG_COMM,
          body(5, "return comm.all_reduce(g, ctx.group).chunk(ctx.group.size, dim=SEQ_DIM)[ctx.group.rank], None")),
    wrong("4a", "_Reduce.backward all-reduces too: the gradient summed twice", "_Reduce (leave, no SP) backward",
          body(2, "ctx.group = group\nreturn comm.all_reduce(x, group)"),
          body(3, "return comm.all_reduce(g, ctx.group), None")),
    wrong("4a", "_GatherSeq.forward gathers along the batch, not the sequence", "_GatherSeq (enter, SP) forward",
          body(4, "ctx.group = group\nreturn comm.all_gather(x, group, dim=0)")),
    wrong("4a", "_Reduce.forward all-reduces its input in place (inplace=True), without ctx.mark_dirty",
          "_Reduce (leave, no SP) forward on rank 0: " + WROTE_INTO + " its input x",
          body(2, "return comm.all_reduce(x, group, inplace=True)")),
    wrong("4a", "_Copy.backward all-reduces the incoming gradient in place",
          "_Copy (enter, no SP) backward on rank 0: " + WROTE_INTO + " the incoming gradient",
          body(1, "return comm.all_reduce(g, ctx.group, inplace=True), None")),
    wrong("4a", "_Copy.backward all-reduces the incoming gradient in place through torch.distributed",
          "_Copy (enter, no SP) backward on rank 0: " + WROTE_INTO + " the incoming gradient",
          body(1, "torch.distributed.all_reduce(g, group=ctx.group.pg)\nreturn g, None")),
    right("4a", "_Copy.backward through torch.distributed on the group's own process group",
          body(1, "import torch.distributed as dist\ng = g.clone()\ndist.all_reduce(g, group=ctx.group.pg)\n"
                  "return g, None")),
    right("4a", "_Reduce.forward all-reduces its input in place and says so (ctx.mark_dirty)",
          body(2, "ctx.mark_dirty(x)\nreturn comm.all_reduce(x, group, inplace=True)")),
    # ---- 4b column- and row-parallel linears (regions: 0 column, 1 row) --------------------------
    wrong("4b", "row-parallel returns its partial sum (no leave)", "RowParallelLinear: output",
          body(1, "return F.linear(x, self.weight)")),
    wrong("4b", "row-parallel always all-reduces, then keeps its chunk of T under sequence parallelism",
          "RowParallelLinear with sequence parallel: forward on rank 0: " + WRONG_COMM,
          body(1, """
              y = leave(F.linear(x, self.weight), self.group, False)
              if self.sequence_parallel:
                  y = y.chunk(self.group.size, dim=SEQ_DIM)[self.group.rank]
              return y""")),
    wrong("4b", "row-parallel sums in fp64 'for precision': right values, twice the bytes",
          "RowParallelLinear: forward on rank 0: " + WRONG_COMM,
          body(1, "y = F.linear(x.double(), self.weight.double())\n"
                  "return leave(y, self.group, self.sequence_parallel).to(x.dtype)")),
    wrong("4b", "column-parallel computed in bf16 'to save time'", "ColumnParallelLinear: output",
          body(0, "return F.linear(x.bfloat16(), self.weight.bfloat16()).to(x.dtype)")),
    right("4b", "row-parallel picks the conjugate function itself, matmul with the transpose",
          body(1, "leave_fn = _ScatterSeq if self.sequence_parallel else _Reduce\n"
                  "return leave_fn.apply(x @ self.weight.t(), self.group)")),
    # ---- 4c vocab-parallel cross-entropy ------------------------------------------------------------
    wrong("4c", "no max subtraction: exp overflows for large logits", "large logits",
          sub(CE_SUM, "sum_exp = reduce_sum(torch.exp(logits).sum(dim=-1), group)"),
          sub("return torch.log(sum_exp) + m - z_t", "return torch.log(sum_exp) - z_t")),
    wrong("4c", "adds the ranks' maxima instead of taking their maximum", "large logits",
          sub(CE_MAX, "m = reduce_sum(local_max, group)")),
    wrong("4c", "subtracts each rank's own maximum: the ranks' exponentials on different scales", "logits of about",
          sub(CE_MAX, "m = local_max")),
    wrong("4c", "all-reduces the (B, T, V/tp) exponentials, then sums over the vocabulary: right values, V/tp x the bytes",
          "forward on rank 0: " + WRONG_COMM,
          sub(CE_SUM, "sum_exp = reduce_sum(torch.exp(logits - m.unsqueeze(-1)), group).sum(dim=-1)")),
    wrong("4c", "off by one in who owns the target: local_t <= per_rank", "logits of about",
          sub("mine = (local_t >= 0) & (local_t < per_rank)", "mine = (local_t >= 0) & (local_t <= per_rank)")),
    wrong("4c", "leaves the padded vocabulary entries in the softmax", "logits of about",
          sub(CE_MASK, "pass")),
    wrong("4c", "masks the padding in place (masked_fill_): the caller's logits changed",
          "logits of about +-8: forward on rank 0: " + WROTE_INTO + " its input logits",
          sub(CE_MASK, 'logits.masked_fill_(ids >= vocab_size, float("-inf"))')),
    wrong("4c", "takes the maximum before masking the padding", "large logits",
          sub(CE_MASK, "pass"),
          sub("local_max = logits.detach().amax(dim=-1)",
              "local_max = logits.detach().amax(dim=-1)\n    " + CE_MASK)),
    right("4c", "the global maximum by an all-reduce with op MAX (cheaper than the all-gather at 4 ranks)",
          sub(CE_MAX, "m = local_max.clone()\n    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, "
                      "group=group.pg)")),
    # ---- 5a 1F1B --------------------------------------------------------------------------------------
    wrong("5a", "a warm-up of pp - stage forwards, one too many", "pp=2, m=4, stage=0",
          body(0, ONE_F_ONE_B.replace("min(pp - stage - 1, m)", "min(pp - stage, m)"))),
    wrong("5a", "the warm-up not capped by the number of micro-batches", "fewer micro-batches than stages",
          body(0, ONE_F_ONE_B.replace("min(pp - stage - 1, m)", "pp - stage - 1"))),
    wrong("5a", "steady state backward first, then forward", "pp=2, m=1, stage=1",
          body(0, ONE_F_ONE_B.replace('    if f < m:\n        ops.append(("F", f))\n        f += 1\n    ops.append(("B", b))',
                                      '    ops.append(("B", b))\n    if f < m:\n        ops.append(("F", f))\n        f += 1'))),
    wrong("5a", "the warm-up counted from the wrong end (stage, not pp - 1 - stage)", "pp=2, m=4, stage=0",
          body(0, ONE_F_ONE_B.replace("min(pp - stage - 1, m)", "min(stage, m)"))),
    right("5a", "warm-up, steady pairs and cool-down as three list comprehensions",
          body(0, """
              warm = min(pp - 1 - stage, m)
              steady = [op for i in range(m - warm) for op in (("F", warm + i), ("B", i))]
              return [("F", i) for i in range(warm)] + steady + [("B", i) for i in range(m - warm, m)]""")),
    # ---- 5b exchange plan -------------------------------------------------------------------------------
    wrong("5b", "reads the gradient from the left stage instead of the right", "afab, pp 2, m 3",
          body(0, 'left, right = self.ticks[t][boundary], self.ticks[t][boundary + 1]\n'
                  'act = left[1] if left is not None and left[0] == "F" else None\n'
                  'grad = left[1] if left is not None and left[0] == "B" else None\nreturn act, grad')),
    wrong("5b", "reads the activation from the right stage", "afab, pp 2, m 3",
          body(0, 'left, right = self.ticks[t][boundary], self.ticks[t][boundary + 1]\n'
                  'act = right[1] if right is not None and right[0] == "F" else None\n'
                  'grad = right[1] if right is not None and right[0] == "B" else None\nreturn act, grad')),
    wrong("5b", "forgets that an idle stage's slot is None", "afab, pp 2, m 3",
          body(0, 'left, right = self.ticks[t][boundary], self.ticks[t][boundary + 1]\n'
                  'act = left[1] if left[0] == "F" else None\n'
                  'grad = right[1] if right[0] == "B" else None\nreturn act, grad')),
    wrong("5b", "looks at the next tick instead of the one that just ran", "afab, pp 2, m 3",
          body(0, 'left, right = self.ticks[t + 1][boundary], self.ticks[t + 1][boundary + 1]\n'
                  'act = left[1] if left is not None and left[0] == "F" else None\n'
                  'grad = right[1] if right is not None and right[0] == "B" else None\nreturn act, grad')),
    right("5b", "unpacks the two slots with a helper",
          body(0, """
              def ran(op, kind):
                  return op[1] if op and op[0] == kind else None
              row = self.ticks[t]
              return ran(row[boundary], "F"), ran(row[boundary + 1], "B")""")),
    # ---- 5c interleaved order -------------------------------------------------------------------------
    wrong("5c", "a warm-up of 2(pp-1-stage) forwards: the other chunks' forwards forgotten", "pp=2, m=2, v=2, stage=0",
          sub("warmup = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)", "warmup = min(2 * (pp - 1 - stage), total)")),
    wrong("5c", "a warm-up one forward longer (2(pp-stage) - 1 + (v-1)pp)", "pp=2, m=2, v=2, stage=1",
          sub("warmup = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)",
              "warmup = min(2 * (pp - stage) - 1 + (v - 1) * pp, total)")),
    wrong("5c", "the warm-up not capped by the v m forwards there are", "pp=4, m=4, v=2, stage=0",
          sub("warmup = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)", "warmup = 2 * (pp - 1 - stage) + (v - 1) * pp")),
    wrong("5c", "backwards through the chunks in the forwards' order, not last chunk first", "pp=2, m=2, v=2, stage=0",
          sub('(chunk if kind == "F" else v - 1 - chunk)', "chunk")),
    wrong("5c", "micro-batches in groups of m instead of pp (all of them through chunk 0 first)", "pp=2, m=4, v=2, stage=0",
          sub("group, pos = divmod(j, pp * v)\n        chunk = pos // pp\n        return kind, group * pp + pos % pp,",
              "group, pos = divmod(j, m * v)\n        chunk = pos // m\n        return kind, group * m + pos % m,")),
    right("5c", "the n-th op of a kind by a helper, warm-up, steady pairs and cool-down as list comprehensions",
          body(0, """
              total = v * m

              def nth(j, kind):
                  rnd, pos = divmod(j, pp * v)
                  c = pos // pp
                  return kind, rnd * pp + pos % pp, c if kind == "F" else v - 1 - c

              warm = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)
              steady = [op for j in range(total - warm) for op in (nth(warm + j, "F"), nth(j, "B"))]
              return [nth(j, "F") for j in range(warm)] + steady + [nth(j, "B") for j in range(total - warm, total)]""")),
    # ---- 6a coordinates (regions: 0 coords, 1 rank_of) ----------------------------------------------
    wrong("6a", "numbers pp before dp (pipeline the faster of the two) in coords", "tp=2, pp=2, dp=2",
          body(0, "return rank // (tp * pp), (rank // tp) % pp, rank % tp")),
    wrong("6a", "dp fastest: tensor-parallel ranks no longer neighbours", "tp=2, pp=2, dp=2",
          body(0, "return rank % dp, rank // (tp * dp), (rank // dp) % tp"),
          body(1, "return (pp_rank * tp + tp_rank) * dp + dp_rank")),
    wrong("6a", "rank_of with the dp and pp strides swapped", "tp=1, pp=1, dp=2",
          body(1, "return pp_rank * tp + dp_rank * tp * dp + tp_rank")),
    wrong("6a", "the pp coordinate without dividing by dp", "tp=2, pp=2, dp=2",
          body(0, "return (rank // tp) % dp, (rank // tp) % pp, rank % tp")),
    right("6a", "coordinates with divmod",
          body(0, "rest, tp_rank = divmod(rank, tp)\npp_rank, dp_rank = divmod(rest, dp)\n"
                  "return dp_rank, pp_rank, tp_rank")),
    # ---- 6b process groups --------------------------------------------------------------------------
    wrong("6b", "dp groups built along the pp axis", "the dp groups",
          body(0, MESH.replace("[[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]",
                               "[[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]", 1))),
    wrong("6b", "pp groups only for tp rank 0", "the pp groups",
          body(0, MESH.replace("[[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]",
                               "[[r(d, p, 0) for p in range(pp)] for d in range(dp)]"))),
    wrong("6b", "rank_of's dp and pp arguments swapped in the tp groups", "the tp groups",
          body(0, MESH.replace("[[r(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)]",
                               "[[r(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]"))),
    wrong("6b", "a pp group as every rank of one stage (the ranks sharing the pp coordinate)", "the pp groups",
          body(0, MESH.replace("[[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]",
                               "[[r(d, p, t) for d in range(dp) for t in range(tp)] for p in range(pp)]"))),
    right("6b", "every group by filtering the ranks on the other two coordinates",
          body(0, """
              axis = {"tp": 2, "dp": 0, "pp": 1}.get(kind)
              if axis is not None:
                  world = tp * pp * dp
                  at = {q: coords(q, tp, pp, dp) for q in range(world)}
                  key = lambda q: tuple(c for i, c in enumerate(at[q]) if i != axis)
                  return [[q for q in range(world) if key(q) == k] for k in sorted({key(q) for q in range(world)})]""")),
    # ---- 7a stochastic rounding -----------------------------------------------------------------------
    wrong("7a", "truncates: the noise dropped", "given noise",
          body(0, SR.replace("(bits + noise) & -65536", "bits & -65536"))),
    wrong("7a", "no NaN guard: 0x7FFFFFFF + noise carries into the sign bit", "odd NaN",
          body(0, SR.replace("return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)", "return out"))),
    wrong("7a", "the NaN guard looks at the result, not the input", "odd NaN",
          body(0, SR.replace("torch.where(torch.isnan(x)", "torch.where(torch.isnan(out)"))),
    wrong("7a", "draws its own noise in [0, 2^15): biased", "noise drawn by the function",
          body(0, SR.replace("torch.randint(0, 1 << 16,", "torch.randint(0, 1 << 15,"))),
    wrong("7a", "draws its own noise without the generator it was given", "noise drawn by the function",
          body(0, SR.replace(", device=x.device, generator=generator)", ")"))),
    wrong("7a", "rounds to nearest (x.to(bfloat16)) and ignores the noise", "given noise",
          body(0, "return x.float().to(torch.bfloat16)")),
    wrong("7a", "nan_to_num 'to keep it safe': NaN becomes 0, inf the largest bf16", "odd NaN",
          body(0, SR.replace("return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)",
                             "return torch.nan_to_num(out)"))),
    wrong("7a", "adds the noise in place (bits += noise): x.view(torch.int32) shares the caller's fp32 bytes",
          "given noise: each element rounds up exactly when its low 16 bits + noise carry: "
          "stochastic_round_to_bf16(x, noise): " + WROTE_INTO + " its input x",
          body(0, SR.replace("rounded = (bits + noise) & -65536", "bits += noise\nrounded = bits & -65536"))),
    right("7a", "decides up or down from the low bits, without the masked add",
          body(0, """
              x = x.float().contiguous()
              bits = x.view(torch.int32)
              if noise is None:
                  noise = torch.randint(0, 65536, x.shape, dtype=torch.int32, device=x.device, generator=generator)
              low = bits & 0xFFFF
              down = bits - low
              up = torch.where(torch.isnan(x), down, down + 0x10000)   # a NaN's up would wrap around
              out = torch.where(low + noise >= 0x10000, up, down).view(torch.float32).to(torch.bfloat16)
              return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)""")),
    # ---- 8a resharding --------------------------------------------------------------------------------
    wrong("8a", "narrows at offset part instead of part * size", "split along dim 0 over tp 2",
          body(0, RESHARD.replace("part * size, size), covered.narrow(tp_dim, part * size, size)",
                                  "part, size), covered.narrow(tp_dim, part, size)"))),
    wrong("8a", "the part's size from the tp degree, not the number of parts", "2 parts held by tp 4",
          body(0, RESHARD.replace("// parts", '// sh["tp"]'))),
    wrong("8a", "marks the whole tensor covered by every part: a missing shard goes unnoticed", "shard missing",
          body(0, RESHARD.replace(", covered.narrow(tp_dim, part * size, size)", ", covered"))),
    wrong("8a", "always narrows dimension 0", "split along dim 1 over tp 4",
          body(0, RESHARD.replace("out.narrow(tp_dim,", "out.narrow(0,").replace("covered.narrow(tp_dim,", "covered.narrow(0,"))),
    right("8a", "the part as a tuple of slices (basic indexing gives views too)",
          body(0, """
              dst, cov = out, covered
              if tp_dim >= 0:
                  size = full_shape[tp_dim] // parts
                  where = [slice(None)] * len(full_shape)
                  where[tp_dim] = slice(part * size, (part + 1) * size)
                  dst, cov = out[tuple(where)], covered[tuple(where)]""")),
    # ---- 10a top-k routing with the aux losses ------------------------------------------------------
    wrong("10a", "renormalises the chosen k over all E probabilities (which sum to 1: no renormalisation)",
          "k 2 of E 5, 3 sequences of 7 tokens: weights",
          sub("weights = top_p / top_p.sum(dim=-1, keepdim=True)", "weights = top_p / probs.sum(dim=-1, keepdim=True)")),
    wrong("10a", "f_e from the probabilities of the chosen experts (a gradient through f)",
          "k 2 of E 5, 3 sequences of 7 tokens: through balance: the gradient of",
          sub("chosen = torch.zeros_like(probs).scatter_(-1, experts, 1.0)",
              "chosen = torch.zeros_like(probs).scatter_(-1, experts, 1.0) * probs / probs.detach()")),
    wrong("10a", "f_e and P_e over the whole batch, not per sequence", "3 sequences of 7 tokens: balance",
          sub("balance = E * (f * P).sum(dim=-1)",
              "balance = E * (f.mean(0) * P.mean(0)).sum(dim=-1).expand(f.shape[0])")),
    wrong("10a", "the z-loss without the square", "k 2 of E 5, 3 sequences of 7 tokens: z",
          sub("over_sequence(lse.pow(2))", "over_sequence(lse)")),
    wrong("10a", "the balance loss without the factor E", "k 2 of E 5, 3 sequences of 7 tokens: balance",
          sub("balance = E * (f * P).sum(dim=-1)", "balance = (f * P).sum(dim=-1)")),
    wrong("10a", "top-k over the wrong dim (the tokens, not the experts)", "k 2 of E 5, 3 sequences of 7 tokens",
          sub("top_p, experts = probs.topk(k, dim=-1)", "top_p, experts = probs.topk(k, dim=1)")),
    wrong("10a", "f_e divided by the tokens, not the T*k choices (sums to k)", "k 2 of E 5, 3 sequences of 7 tokens: balance",
          sub("f = over_sequence(chosen) / (T * k)", "f = over_sequence(chosen) / T")),
    wrong("10a", "sums over this rank's tokens only: sequence parallelism's halves not added up over tp",
          "sequence parallelism", sub("P = over_sequence(probs) / T", "P = probs.sum(dim=1) / T")),
    wrong("10a", "the bias ignored (the experts chosen by p alone)", "a bias (--moe-bias-rate)",
          sub("experts = (probs + bias).topk(k, dim=-1).indices", "experts = probs.topk(k, dim=-1).indices")),
    wrong("10a", "the bias in the weights too (it may only choose)", "a bias (--moe-bias-rate)",
          sub("top_p = probs.gather(-1, experts)", "top_p = (probs + bias).gather(-1, experts)")),
    wrong("10a", "the router's matmul in bf16, its logits cast up after (bf16 losses then move)",
          "bf16 inputs (routed in fp32",
          sub("logits = x.to(dtype) @ w_router.to(dtype).t()", "logits = (x @ w_router.t()).to(dtype)")),
    wrong("10a", "the z-loss's logsumexp as log(exp(logits).sum()): overflows past logits of about 88", "large logits",
          sub("lse = torch.logsumexp(logits, dim=-1)", "lse = torch.log(torch.exp(logits).sum(dim=-1))")),
    right("10a", "renormalising with an epsilon in the denominator",
          sub("weights = top_p / top_p.sum(dim=-1, keepdim=True)",
              "weights = top_p / (top_p.sum(dim=-1, keepdim=True) + 1e-9)")),
    right("10a", "top-k on the logits, the weights a softmax over the chosen k logits (Mixtral's way), "
          "f from a scatter of ones", body(0, """
              logits = x.to(dtype) @ w_router.to(dtype).t()
              top_logits, experts = logits.topk(k, dim=-1)
              weights = top_logits.softmax(dim=-1)
              probs = logits.softmax(dim=-1)
              if bias is not None:
                  experts = (probs + bias).topk(k, dim=-1).indices
                  weights = logits.gather(-1, experts).softmax(dim=-1)
              ones = torch.ones(experts.shape, dtype=dtype, device=x.device)
              chosen = torch.zeros(logits.shape, dtype=dtype, device=x.device).scatter_add(2, experts, ones)
              f, P = over_sequence(chosen) / (T * k), over_sequence(probs) / T
              z = over_sequence(torch.logsumexp(logits, dim=-1) ** 2) / T
              return experts, weights.to(x.dtype), E * (f * P).sum(dim=-1), z""")),
    # ---- 10b the sorted dispatch -------------------------------------------------------------------
    wrong("10b", "index_copy back instead of index_add (a token keeps one of its k results)",
          "9 tokens, k 2 of E 4: y", sub("return torch.zeros_like(x).index_add(0, token, out)",
                                         "return torch.zeros_like(x).index_copy(0, token, out)")),
    wrong("10b", "the weights in the unsorted order", "9 tokens, k 2 of E 4: y",
          sub("out * weights.reshape(-1)[order].unsqueeze(-1)", "out * weights.reshape(-1).unsqueeze(-1)")),
    wrong("10b", "the token of choice j as j % k (its rank) instead of j // k", "9 tokens, k 2 of E 4: y",
          sub("token = order // k\n    xs = x[token]", "token = order % k\n    xs = x[token]")),
    wrong("10b", "each expert's slice taken in expert order but the tokens left unsorted", "9 tokens, k 2 of E 4: y",
          sub("xs = x[token]  ", "xs = x[torch.arange(N * k) // k]  ")),
    wrong("10b", "the weight applied to the token before its expert (SwiGLU is not linear)", "9 tokens, k 2 of E 4: y",
          body(0, """
              N, k = experts.shape
              flat = experts.reshape(-1)
              order = flat.argsort(stable=True)
              token = order // k
              xs = x[token] * weights.reshape(-1)[order].unsqueeze(-1)
              counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
              outs = [swiglu(chunk, gate[e], up[e], down[e]) for e, chunk in enumerate(xs.split(counts))]
              return torch.zeros_like(x).index_add(0, token, torch.cat(outs))""")),
    wrong("10b", "the combine written into its input (x zeroed, then index_add_): train.py's backward then fails",
          "9 tokens, k 2 of E 4: dispatch_sorted: " + WROTE_INTO + " x",
          sub("return torch.zeros_like(x).index_add(0, token, out)", "return x.detach().zero_().index_add_(0, token, out)")),
    wrong("10b", "the combine in fp32 whatever the input (--precision bf16 then fails in the next matmul)",
          "bf16 inputs (--precision bf16: y in bf16",
          sub("return torch.zeros_like(x).index_add(0, token, out)",
              "up = torch.promote_types(x.dtype, torch.float32)\n"
              "    return torch.zeros_like(x, dtype=up).index_add(0, token, out.to(up))")),
    right("10b", "an unstable sort, and back by the inverse permutation, summed over the k", body(0, """
              N, k = experts.shape
              order = experts.reshape(-1).argsort()
              counts = torch.bincount(experts.reshape(-1), minlength=gate.shape[0]).tolist()
              xs = x[order // k].split(counts)
              out = torch.cat([swiglu(c, gate[e], up[e], down[e]) for e, c in enumerate(xs)])
              out = out[order.argsort()].view(N, k, -1)            # choice j back at row j
              return (out * weights.unsqueeze(-1)).sum(dim=1)""")),
    right("10b", "experts with no token skipped (the stacked weights' gradient is still whole: zeros there)",
          body(0, """
              N, k = experts.shape
              flat = experts.reshape(-1)
              order = flat.argsort(stable=True)
              token = order // k
              counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
              gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)
              outs = [swiglu(c, gates[e], ups[e], downs[e]) for e, c in enumerate(x[token].split(counts)) if len(c)]
              out = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(-1)
              return torch.zeros_like(x).index_add(0, token, out)""")),
    # ---- 10c the expert-parallel groups --------------------------------------------------------------
    wrong("10c", "ep_dp the ep groups themselves (the gradients summed over ranks holding other experts)",
          "dp 4, ep 2: rank", body(0, """
              return [[r(d, p, t) for d in range(i, i + ep)] for p in range(pp) for t in range(tp) for i in range(0, dp, ep)]""")),
    wrong("10c", "ep_dp the whole dp group (each expert's gradient mixed with the other experts')", "dp 4, ep 2: rank",
          sub("return [[r(d, p, t) for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) for j in range(ep)]",
              "return [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]")),
    wrong("10c", "ep strided and ep_dp contiguous: the right sums, through the wrong groups",
          "dp 4, ep 2: rank 0: right values, but the tokens' all-to-all ran on ranks [0, 2]", body(0, """
              if kind == "ep":
                  return [[r(d, p, t) for d in range(j, dp, dp // ep)] for p in range(pp) for t in range(tp)
                          for j in range(dp // ep)]
              return [[r(d, p, t) for d in range(i, i + dp // ep)] for p in range(pp) for t in range(tp)
                      for i in range(0, dp, dp // ep)]""")),
    wrong("10c", "ep_dp strided by dp / ep instead of ep (right at dp 4, ep 2 only)", "dp 4, ep 4: rank 0: the summed",
          sub("for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) for j in range(ep)]",
              "for d in range(j, dp, dp // ep)] for p in range(pp) for t in range(tp) for j in range(dp // ep)]")),
    wrong("10c", "the groups of tp rank 0 only", "tp=2, pp=1, dp=4, ep=2, the ep groups",
          sub("for p in range(pp) for t in range(tp) for i in range(0, dp, ep)]",
              "for p in range(pp) for t in range(1) for i in range(0, dp, ep)]")),
    right("10c", "from the coordinates: the ranks whose dp rank has the same run (ep) or place (ep_dp)", body(0, """
              key = (lambda d: d // ep) if kind == "ep" else (lambda d: d % ep)
              groups = {}
              for p in range(pp):
                  for t in range(tp):
                      for d in range(dp):
                          groups.setdefault((p, t, key(d)), []).append(r(d, p, t))
              return list(groups.values())""")),
    # ---- 11a the online-softmax merge -----------------------------------------------------------
    wrong("11a", "no running max: exp(lse) itself, which overflows fp32 past about 88", "large logits",
          body(0, """
              w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
              total = w_a + w_b
              return (w_a[..., None] * o_a + w_b[..., None] * o_b) / total[..., None], torch.log(total)""")),
    wrong("11a", "averages the two partial outputs (each block's softmax weighted alike)", "two blocks of 6 keys",
          body(0, "return (o_a + o_b) / 2, torch.logaddexp(lse_a, lse_b)")),
    wrong("11a", "returns the running max as the merged lse (forgets + log of the summed weights)",
          "two blocks of 6 keys: the merged lse", sub("return o, m + torch.log(total)", "return o, m")),
    wrong("11a", "scales its first input in place (o_a *= its weight)", "two blocks of 6 keys: merge: " + WROTE_INTO + " o_a",
          sub("o = (w_a[..., None] * o_a + w_b[..., None] * o_b)", "o = (o_a.mul_(w_a[..., None]) + w_b[..., None] * o_b)")),
    wrong("11a", "the weights swapped (block b's weight on block a's output)", "two blocks of 6 keys",
          sub("(w_a[..., None] * o_a + w_b[..., None] * o_b)", "(w_b[..., None] * o_a + w_a[..., None] * o_b)")),
    right("11a", "logaddexp for the merged lse, each block's weight exp(lse_b - lse), 0 where both are -inf",
          body(0, """
              lse = torch.logaddexp(lse_a, lse_b)
              w_a = torch.exp(lse_a - lse).nan_to_num(0.0)
              w_b = torch.exp(lse_b - lse).nan_to_num(0.0)
              return w_a[..., None] * o_a + w_b[..., None] * o_b, lse""")),
    right("11a", "logaddexp, no guard (a row with lse -inf in both inputs never reaches the ring's merge)",
          body(0, """
              lse = torch.logaddexp(lse_a, lse_b)
              return torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b, lse""")),
    right("11a", "the sigmoid form: o_a - sigmoid(lse_b - lse_a) (o_a - o_b), lse_a - logsigmoid(lse_a - lse_b)",
          body(0, """
              o = o_a - torch.sigmoid(lse_b - lse_a)[..., None] * (o_a - o_b)
              return o, lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)""")),
    # ---- 11b the zigzag split ---------------------------------------------------------------------
    wrong("11b", "a contiguous split: rank i holds tokens i t .. (i+1) t - 1", "T=8, cp=2): the causal work",
          body(0, "return torch.arange(T).view(cp, T // cp)")),
    wrong("11b", "rank i holds chunks i and 2cp-i (off by one)", "T=6, cp=1): the table",
          sub("(2 * cp - 1 - i) * c, (2 * cp - i) * c", "(2 * cp - i) * c, (2 * cp + 1 - i) * c")),
    wrong("11b", "every rank's positions its own 0..t-1 (local positions)", "T=8, cp=2): the table",
          body(0, "return torch.arange(T // cp).repeat(cp, 1)")),
    wrong("11b", "split_sequence returns local positions 0..t-1", "over cp=2, rank 0: positions",
          sub("return inputs[:, positions], targets[:, positions], positions",
              "return inputs[:, positions], targets[:, positions], torch.arange(len(positions))")),
    wrong("11b", "shifts after the split: the last token of a chunk gets the next chunk's first as target",
          "over cp=2, rank 0: targets", body(1, """
              positions = zigzag_positions(tokens.shape[1] - 1, cp)[rank]
              mine = tokens[:, torch.cat([positions, positions[-1:] + 1])]
              return mine[:, :-1], mine[:, 1:], positions""")),
    right("11b", "int32 positions", sub("return torch.stack(rows)", "return torch.stack(rows).int()")),
    right("11b", "the 2cp chunks as rows of a view, the late ones flipped; targets at positions + 1",
          body(0, """
              chunks = torch.arange(T).view(2 * cp, T // (2 * cp))
              return torch.cat([chunks[:cp], chunks.flip(0)[:cp]], dim=1)"""),
          body(1, """
              positions = zigzag_positions(tokens.shape[1] - 1, cp)[rank]
              return tokens[:, positions], tokens[:, positions + 1], positions""")),
    # ---- 11c the ring's backward ------------------------------------------------------------------
    wrong("11c", "a stale K/V block: the fp32 copies of K and V taken once, before the ring turns", "cp 4, fp32: dq",
          body(0, RING.replace("    kc, vc = kv[0].float().chunk(2, 2), kv[1].float().chunk(2, 2)\n", "")
               .replace("for s in range(n):\n", "kc, vc = kv[0].float().chunk(2, 2), kv[1].float().chunk(2, 2)\n"
                        "for s in range(n):\n"))),
    wrong("11c", "dK/dV not sent home: no hop after the last step (each rank keeps its neighbour's)",
          "cp 4, fp32: dk", sub('dkv, dkv_handles = comm.start_ring_shift(dkv, group, -1, f"bwd dK/dV {s + 1}/{n}")',
                                "dkv, dkv_handles = comm.start_ring_shift(dkv, group, -1) if s < n - 1 else (dkv, [])")),
    wrong("11c", "dK/dV sent the forward's way (+1) while their K/V block goes the other", "cp 4, fp32: dk",
          sub('dkv, dkv_handles = comm.start_ring_shift(dkv, group, -1, f"bwd dK/dV {s + 1}/{n}")',
              "dkv, dkv_handles = comm.start_ring_shift(dkv, group, +1)")),
    wrong("11c", "dK/dV accumulated in the inputs' dtype (bf16: rounded at every hop)", "cp 4, bf16 inputs",
          sub("dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)",
              "dkv = torch.zeros(kv.shape, dtype=kv.dtype, device=kv.device)")),
    wrong("11c", "every block's dK/dV kept in a full buffer and all-reduced at the end", "cp 4, fp32 backward on "
          "rank 0: " + WRONG_COMM + " this rank sent", ring("""
              kv = torch.stack([k, v])
              dkv_all = torch.zeros((n,) + tuple(kv.shape), dtype=torch.float32, device=kv.device)
              for s in range(n):
                  if s < n - 1:
                      arriving, handles = comm.start_ring_shift(kv, group, -1)
                  kc, vc = kv[0].float().chunk(2, 2), kv[1].float().chunk(2, 2)
                  r = (me + s) % n
                  dk, dv = list(dkv_all[r, 0].chunk(2, 2)), list(dkv_all[r, 1].chunk(2, 2))""", """
                  if s < n - 1:
                      for h in handles:
                          h.wait()
                      kv = arriving
              dkv = comm.all_reduce(dkv_all, group)[me]""")),
    wrong("11c", "all of K/V all-gathered and dK/dV reduce-scattered (the allgather algorithm's exchange)",
          "cp 4, fp32 backward on rank 0: " + WRONG_COMM + " an all_gather", ring("""
              kv = comm.all_gather(torch.stack([k, v]), group, dim=3)   # (2, B, K, n t, D): every block
              dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
              t = k.shape[2]
              for r in range(n):
                  kc = kv[0, :, :, r * t:(r + 1) * t].float().chunk(2, 2)
                  vc = kv[1, :, :, r * t:(r + 1) * t].float().chunk(2, 2)
                  dk = list(dkv[0, :, :, r * t:(r + 1) * t].chunk(2, 2))
                  dv = list(dkv[1, :, :, r * t:(r + 1) * t].chunk(2, 2))""", "",
               "dkv = comm.reduce_scatter(dkv, group, dim=3)\n" + RING_RETURN)),
    wrong("11c", "the arriving K/V block's wait deleted (gloo delivers in order: the race is hidden)",
          "cp 4, fp32 backward on rank 0: right values, but the recv", sub(
              "for h in dkv_handles + (handles if s < n - 1 else []):", "for h in dkv_handles:")),
    wrong("11c", "each K/V shift waited right after it starts (no overlap: what the ring exists for)",
          "cp 4, fp32 backward on rank 0: right values, but no block travelled", sub(
              'arriving, handles = comm.start_ring_shift(kv, group, -1, f"bwd K/V {s + 1}/{n - 1}")',
              'arriving, handles = comm.start_ring_shift(kv, group, -1, f"bwd K/V {s + 1}/{n - 1}")\n'
              '                for h in handles:\n                    h.wait()\n                handles = []')),
    Plant("11c", "a dK/dV handle waited twice (a deadlock)", [sub(
              "for h in dkv_handles + (handles if s < n - 1 else []):",
              "for h in dkv_handles + dkv_handles + (handles if s < n - 1 else []):")],
          catches="a deadlock: for", extra={"within_s": 30}),
    right("11c", "the ring turning the forward's way (+1) in both passes, the blocks' indices to match",
          sub('comm.start_ring_shift(kv, group, -1, f"bwd K/V', 'comm.start_ring_shift(kv, group, +1, f"bwd K/V'),
          sub("positions[(me + s) % n]", "positions[(me - s) % n]"),
          sub('comm.start_ring_shift(dkv, group, -1, f"bwd dK/dV', 'comm.start_ring_shift(dkv, group, +1, f"bwd dK/dV')),
    right("11c", "dK and dV returned in fp32 (autograd casts them to the inputs' dtype)",
          sub(RING_RETURN, "return torch.cat(dq, 2), dkv[0], dkv[1], None, None")),
    right("11c", "K, V, dK and dV as four messages a step (more calls, the same bytes)", ring("""
              kk, vv = k, v
              dk_home = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
              dv_home = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
              for s in range(n):
                  r = (me + s) % n
                  handles = []
                  if s < n - 1:
                      (k_next, h1), (v_next, h2) = comm.start_ring_shift(kk, group, -1), comm.start_ring_shift(vv, group, -1)
                      handles = h1 + h2
                  kc, vc = kk.float().chunk(2, 2), vv.float().chunk(2, 2)
                  dk, dv = list(dk_home.chunk(2, 2)), list(dv_home.chunk(2, 2))""", """
                  if s < n - 1:
                      kk, vv = k_next, v_next
                  (dk_home, h3), (dv_home, h4) = (comm.start_ring_shift(dk_home, group, -1),
                                                  comm.start_ring_shift(dv_home, group, -1))
                  for h in handles + h3 + h4:
                      h.wait()""", "return torch.cat(dq, 2).to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype), None, None")),
]


# ---------------------------------------------------------------------------
# Planting
# ---------------------------------------------------------------------------

def regions_of(text: str, ex: str) -> list[tuple[int, int, str]]:
    """[(begin line, end line, indent)] of exercise ex's regions in `text`, in order."""
    out, lines, open_at = [], text.splitlines(), None
    for i, line in enumerate(lines):
        m = BEGIN.match(line)
        if m and m.group(2) == ex:
            open_at = (i, m.group(1))
        elif END.match(line) and open_at and END.match(line).group(1) == ex:
            out.append((open_at[0], i, open_at[1]))
            open_at = None
    return out


def plant(root: str, p: Plant) -> dict[str, str]:
    """{file: its text with p's edits}, read from the copy at `root`."""
    from nanohlat.classroom import kit
    files = sorted({r[0] for r in kit.find_regions(root)[p.ex]})
    texts = {rel: open(os.path.join(root, rel), encoding="utf-8").read() for rel in files}
    changed = {}
    k_base, spans = 0, []
    for rel in files:
        n = len(regions_of(texts[rel], p.ex))
        spans.append((rel, k_base, n))
        k_base += n
    for edit in p.edits:
        if edit[0] == "body":
            _, k, code = edit
            rel, base, _ = next(s for s in spans if s[1] <= k < s[1] + s[2])
            text = changed.get(rel, texts[rel])
            b, e, indent = regions_of(text, p.ex)[k - base]
            lines = text.splitlines()
            new = [indent + ln if ln.strip() else "" for ln in code.splitlines()]
            changed[rel] = "\n".join(lines[:b + 1] + new + lines[e:]) + "\n"
        else:
            _, old, new = edit
            hits = [rel for rel in files if old in changed.get(rel, texts[rel])]
            assert len(hits) == 1, f"{p.ex} ({p.what}): {old!r} is not in exactly one file"
            text = changed.get(hits[0], texts[hits[0]])
            assert text.count(old) == 1, f"{p.ex} ({p.what}): {old!r} is not unique"
            at = text.index(old)
            lines_before = text[:at].count("\n")
            assert any(b < lines_before < e for b, e, _ in regions_of(text, p.ex)), \
                f"{p.ex} ({p.what}): {old!r} is outside the exercise's regions"
            changed[hits[0]] = text.replace(old, new)
    for rel, text in changed.items():
        compile(text, rel, "exec")        # a plant that does not even compile would test nothing
        assert text != texts[rel]
    return changed


DRIVER = r'''
import json, os, sys, time
sys.dont_write_bytecode = True
plan = json.load(open(sys.argv[1]))
results = []
for item in plan:
    saved = {}
    for rel, text in item["files"].items():
        saved[rel] = open(rel, encoding="utf-8").read()
        open(rel, "w", encoding="utf-8").write(text)
    for name in [m for m in sys.modules if m == "nanohlat" or m.startswith("nanohlat.")]:
        del sys.modules[name]                      # import the planted code afresh
    from nanohlat.classroom import checks, kit
    start = time.perf_counter()
    verdict = checks.run(kit.BY_ID[item["ex"]])
    results.append({"verdict": verdict, "seconds": time.perf_counter() - start})
    for rel, text in saved.items():
        open(rel, "w", encoding="utf-8").write(text)
json.dump(results, open(sys.argv[2], "w"))
'''


def chosen(ex: str) -> bool:
    """Whether exercise ex's plants run: NANOHLAT_PLANTS names chapters (10) or exercises (10a), or nothing: all."""
    only = os.environ.get("NANOHLAT_PLANTS", "").split()
    return not only or ex in only or ex[:-1] in only


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every plant's verdict (and the reference's, for each exercise), from one subprocess."""
    from nanohlat.classroom import kit
    dest = tmp_path_factory.mktemp("mistakes") / "copy"
    kit.make_copy(str(dest), [], ROOT)
    reference = [Plant(e.id, "the reference", [], right=True) for e in kit.EXERCISES]
    plants = [p for p in reference + PLANTS if chosen(p.ex)]
    plan = [{"ex": p.ex, "files": plant(str(dest), p)} for p in plants]
    (dest / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", DRIVER, "plan.json", "results.json"], cwd=dest, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((dest / "results.json").read_text())
    print(f"\n{len(plants)} plants checked in {time.perf_counter() - start:.0f} s; slowest: "
          + ", ".join(f"{p.ex} {res['seconds']:.1f} s" for p, res in
                      sorted(zip(plants, results), key=lambda x: -x[1]["seconds"])[:3]))
    return list(zip(plants, results))


@pytest.mark.slow
def test_every_planted_mistake_fails_with_the_case_that_caught_it(outcomes):
    missed = []
    for p, res in outcomes:
        v = res["verdict"]
        if p.right:
            continue
        if v is None or v.startswith("not done yet") or p.catches not in v:
            missed.append(f"{p.ex} {p.what}: expected a verdict naming {p.catches!r}, got {v!r}")
        elif res["seconds"] > p.extra.get("within_s", float("inf")):   # (a hang: stopped and named in time)
            missed.append(f"{p.ex} {p.what}: its verdict took {res['seconds']:.0f} s, more than {p.extra['within_s']} s")
        if "within_s" in p.extra:
            print(f"{p.ex} {p.what}: {res['seconds']:.1f} s: {v}")
    assert not missed, "\n".join(missed)


@pytest.mark.slow
def test_the_reference_and_every_correct_rewrite_pass(outcomes):
    failed = [f"{p.ex} {p.what}: {res['verdict']}" for p, res in outcomes if p.right and res["verdict"] is not None]
    assert not failed, "\n".join(failed)


def test_the_plants_cover_every_exercise_and_chapter():
    """At least 3 mistakes per exercise and a correct rewrite per chapter; the
    communication exercises each have a mistake with right values through a dearer
    collective or the wrong group; the hostile inputs each catch one."""
    from nanohlat.classroom import kit
    for e in kit.EXERCISES:
        n = sum(1 for p in PLANTS if p.ex == e.id and not p.right)
        assert n >= 3, f"exercise {e.id}: {n} planted mistakes"
    chapters = {e.chapter for e in kit.EXERCISES}
    assert chapters <= {int(p.ex[:-1]) for p in PLANTS if p.right}
    for ex in ("3b", "3c", "3d", "3e", "4a", "4b", "4c", "10c", "11c"):
        assert any(WRONG_COMM in p.catches for p in PLANTS if p.ex == ex), ex
    for ex in ("3a", "3b", "3d", "3e", "4a"):
        assert any("default (world)" in p.catches for p in PLANTS if p.ex == ex), ex
    for ex, words in (("4c", "large logits"), ("7a", "odd NaN"), ("7a", "noise drawn by the function"),
                      ("1a", "1.5 bf16 steps"), ("1c", "ragged rows"), ("11a", "large logits"),
                      ("11c", "bf16 inputs"), ("11c", "a deadlock"), ("10a", "large logits"),
                      ("10b", "bf16 inputs"), ("11c", "no block travelled"), ("10a", "sequence parallelism"),
                      ("10a", "through balance")):
        assert any(words in p.catches for p in PLANTS if p.ex == ex), (ex, words)
    # docs/teaching.md says how many there are
    mistakes = [p for p in PLANTS if not p.right]
    per = [sum(1 for p in mistakes if p.ex == e.id) for e in kit.EXERCISES]
    with open(os.path.join(ROOT, "docs", "teaching.md"), encoding="utf-8") as f:
        guide = " ".join(f.read().split())
    assert f"plants {len(mistakes)} realistic wrong implementations ({min(per)} to {max(per)} per exercise" in guide
