"""The planted mistakes and correct rewrites of chapters 1 to 8's exercises (1a-1c the model's pieces,
3a-3e data parallelism and ZeRO, 4a-4c tensor parallelism, 5a-5c the pipeline, 6a-6b the mesh,
7a stochastic rounding, 8a resharding, 8b --async-save's order), which test_classroom_mistakes.py plants (Plant: plants.py)."""

from __future__ import annotations

from plants import WRONG_COMM, WROTE_INTO, body, reference, right, sub, wrong


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
ZERO2_RS = "s.grad[a:b].add_(comm.reduce_scatter(piece, self.group, what=(s.grad, k)))"


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
    # ---- 8b --async-save's order of operations ---------------------------------------------------------
    wrong("8b", "takes the snapshot in the writer thread: the next step changes what it copies", "end of step 2",
          body(0, """
              if self.in_flight() is not None:
                  self.wait_for_previous(step)
              begin(out_dir, step, self.mesh, self.device)
              threading.Thread(target=lambda: self.start_writer(snapshot(out_dir, step, **kwargs))).start()""")),
    wrong("8b", "waits for its own writer: a synchronous save in a thread", "end of step 2",
          sub("self.start_writer(snap)                    # a thread writes it; training goes on",
              "self.start_writer(snap)\n            self.thread.join()")),
    wrong("8b", "starts the writer before begin made the folder", "end of step 2",
          body(0, """
              if self.in_flight() is not None:
                  self.wait_for_previous(step)
              snap = snapshot(out_dir, step, **kwargs)
              if snap is not None:
                  self.start_writer(snap)
              begin(out_dir, step, self.mesh, self.device)""")),
    wrong("8b", "never finishes the save in flight: two at once, begin removing the first one's folder",
          "while step 2's is still being written",
          sub("""if self.in_flight() is not None:
            self.wait_for_previous(step)               # written, gathered, published (every rank together)
        """, "")),
    wrong("8b", "finishes the save in flight but does not wait for rank 0 to publish it",
          "while step 2's is still being written",
          sub("self.wait_for_previous(step)               # written, gathered, published (every rank together)",
              "self.finish()")),
    right("8b", "the snapshot before begin (both on the step's thread, before the writer starts)",
          body(0, """
              if self.in_flight() is not None:
                  self.wait_for_previous(step)
              snap = snapshot(out_dir, step, **kwargs)
              begin(out_dir, step, self.mesh, self.device)
              if snap is not None:
                  self.start_writer(snap)""")),
]
