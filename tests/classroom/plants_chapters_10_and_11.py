"""The planted mistakes and correct rewrites of chapters 10 and 11's exercises (10a-10c a mixture of
experts: routing, the sorted dispatch, the expert-parallel groups; 11a-11c context parallelism:
the online-softmax merge, the zigzag split, the ring's backward), which test_classroom_mistakes.py
plants (Plant: plants.py)."""

from __future__ import annotations

import textwrap

from plants import WRONG_COMM, WROTE_INTO, Plant, body, reference, right, sub, wrong


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
