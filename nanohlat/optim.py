"""AdamW over flat buffers, the learning-rate schedule, and the global grad norm.

One optimizer serves every layout. Each parameter is a view of a flat buffer
(XLA keeps no view aliased from one graph to the next: there the step gathers
the buffer from the parameters and scatters it back, FlatGroup.load/store), one
per *group* (weight-decayed or not x tp-sharded, replicated, or in fewer parts
than tp: replicated kv heads), with fp32 gradients, Adam's moments and master
weights (all, or this dp rank's 1/dp with --zero 1): the parameters themselves,
unless bf16-mixed's fp32 copy (precision.py). Read `reference_adamw_step` first:
AdamW per parameter, textbook, what FlatAdamW computes (tests/core/test_optim.py
checks the two against each other).

The gradients go into flat fp32 buffers: a hook on every parameter (`attach`: the DP
strategy's `grad_hook`, data_parallel.accumulate_hook) adds each micro-batch's gradient
into its buffer as autograd produces it and sets `p.grad` to None (tools/fast_adamw.py's
subclass: p.grad is the view of the buffer autograd adds into). A step is four phases, each a public
method (train.py calls them by name):

    1. reduce_gradients   flat fp32 grads -> dp all-reduce (or ZeRO-1 reduce-scatter;
                          buckets overlapped with the backward: only waited for)
    2. global_grad_norm   one number over all ranks, each parameter counted once
    3. update             clip, then plain AdamW on the (shard of the) master
    4. write_back         (ZeRO-1 all-gather) -> the model's parameters

Data parallelism enters (phases 1, 2, 4) through one object, `opt.dp`:
`data_parallel.ReplicatedDP`, or `zero1.ZeroOneDP` (--zero 1); the code that builds the
optimizer may hand it another strategy with the same methods (run/build.py).

The global grad norm (docs/design.md 5.4) must count every parameter exactly once:
  * tp-sharded weights: each tp rank holds different elements -> sum over tp;
  * tp-replicated weights (the RMSNorm gains) are identical on all tp ranks ->
    each rank adds 1/tp of their square, so the sum over tp counts them once;
    likewise kv heads shared by r tp ranks (tp > n_kv_heads): 1/r each;
  * pipeline stages hold disjoint layers -> sum over pp;
  * dp replicas hold the same gradients after the all-reduce -> count once,
    except under ZeRO, where each dp rank holds a different shard -> sum over dp;
  * a parameter cut over another group of ranks than tp (p.shard.group), whole on every
    tp rank: each rank of that group holds other parts -> sum over it (ZeRO: the sum over dp does).
Get any of these wrong and clipping silently differs between layouts.

Every holder of an element (dp replicas, tp-replicated norms) computes the same
update for it, bit for bit, rounding noise included (precision.round_into_master).
On XLA the graph is the same every step: lr and the step count are tensors; a
non-finite step is multiplied by 0.0, not skipped.
"""

from __future__ import annotations

import math

import torch

from . import comm, data_parallel, zero1
from .precision import master_dtype, moment_dtype, round_into_master, shard_pieces

NORM_CHUNK = 1 << 20   # elements of a buffer sum_of_squares copies to fp64 at a time (plan/ counts them)


def cosine_lr(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `total` steps (step counts from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def reference_adamw_step(params, grads, state: dict, lr: float, tcfg) -> torch.Tensor:
    """AdamW (Loshchilov & Hutter 2019) per parameter in textbook ops, one process: what FlatAdamW
    computes over its flat buffers. Matrices are weight-decayed, vectors (norm gains) not. `state`
    starts as {}. Returns the global grad norm."""
    b1, b2, eps, wd = tcfg.beta1, tcfg.beta2, tcfg.adam_eps, tcfg.weight_decay
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads)).float()   # global grad norm
    clip = min(1.0, tcfg.grad_clip / (norm.item() + 1e-6)) if tcfg.grad_clip > 0 else 1.0
    if not state:
        state.update(step=0, m=[torch.zeros_like(p) for p in params], v=[torch.zeros_like(p) for p in params])
    state["step"] += 1
    bc1, bc2 = 1 - b1 ** state["step"], 1 - b2 ** state["step"]      # bias corrections
    for p, g, m, v in zip(params, grads, state["m"], state["v"]):
        g = clip * g                                                  # clip by the global norm
        m.copy_(b1 * m + (1 - b1) * g)                                # first moment
        v.copy_(b2 * v + (1 - b2) * g * g)                            # second moment
        if p.ndim >= 2:
            p.copy_(p * (1 - lr * wd))                                # decoupled weight decay
        p.copy_(p - lr * (m / bc1) / (torch.sqrt(v / bc2) + eps))     # the Adam step
    return norm


def sum_of_squares(x: torch.Tensor, exact: bool, chunk: int | None = None) -> torch.Tensor:
    """sum(x^2) of a flat fp32 buffer, part of the grad-norm rule: the layouts' norms must agree
    as their gradients do (~1e-9 relative), and an fp32 sum of a million squares adds ~1e-5.
    So `exact` (cpu, cuda) sums in fp64, by chunks; XLA (trn1 has no fp64) takes an fp32 dot."""
    if not exact:
        return torch.dot(x, x)
    total, chunk = torch.zeros((), dtype=torch.float64, device=x.device), chunk or NORM_CHUNK
    for a in range(0, x.numel(), chunk):
        c = x[a:a + chunk].double()
        total += torch.dot(c, c)
        del c   # before the next chunk is made: one fp64 chunk alive at a time, not two
    return total


class FlatGroup:
    """One flat buffer of parameters and its (shard of) optimizer state."""

    def __init__(self, names, params, decay: bool, tp_replicated: bool, dp, mdtype, sdtype, device,
                 tp_rank=0, tp=1):
        self.names, self.params, self.dp = names, params, dp    # dp: the strategy reducing these gradients
        self.decay, self.tp_replicated = decay, tp_replicated
        # tp ranks holding partial sums of these gradients, added over that group in phase 1: SP's
        # norms saw only their rank's tokens, the kv heads' copies only their own query heads. A
        # parameter cut over another group of ranks than tp (a mixture's experts, spread over expert
        # parallelism's ranks) is whole on every tp rank, as the norms are
        whole = tp_replicated or params[0].shard.group != "tp"
        sp = tp > 1 and whole and any(p.shard.sequence_parallel for p in params)
        self.partial = "tp" if sp else "kv" if not whole and tp // params[0].shard.parts > 1 else None
        self.numel = sum(p.numel() for p in params)
        self.padded, self.start, self.stop = dp.layout(self.numel)
        self.offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        # each parameter's piece of this rank's [start, stop): what bf16-sr's noise is keyed by (precision.py)
        self.pieces = shard_pieces(names, params, self.offsets, self.start, self.stop, tp_rank, tp)
        # the parameters in one flat buffer (zero-padded to a multiple of dp), each a view of it: cpu, cuda;
        # XLA keeps no view aliased across graphs (each one a new buffer, every graph new): see load, store
        self.aliased = torch.device(device).type != "xla"
        self.flat = self.flatten([p.detach() for p in params], params[0].dtype)
        # fp32 gradients (dp.grad_length: all of them, or a strategy's shard), added in as autograd
        # makes them (FlatAdamW.attach); later AdamW's scratch
        self.grad = torch.zeros(dp.grad_length(self.padded), dtype=torch.float32, device=device)
        self.dp_state = dp.track(self)                   # the DP strategy's own object for this group
        # this rank's (shard of the) parameters: a view of the flat buffer, or a copy the strategy keeps
        kept = self.dp_state.param_shard
        mine = kept if kept is not None else self.flat[self.start:self.stop]
        self.master_is_params = mdtype == mine.dtype     # else bf16-mixed's separate fp32 master
        self.master = mine if self.master_is_params else mine.to(mdtype)
        self.exp_avg = torch.zeros(self.stop - self.start, dtype=sdtype, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        for p, off in zip(params, self.offsets):
            if self.aliased:
                p.data = self.flat[off:off + p.numel()].view_as(p)
        self.store()                                     # (xla: no flat buffer kept between steps)

    def gathered(self) -> torch.Tensor:
        """The flat parameter buffer: kept (aliased), gathered from the parameters (xla), or as the DP
        strategy has it."""
        return self.dp.gathered(self)

    def load(self) -> None:
        """xla, before the update: the flat buffer (and the master, if it is the parameters), in-graph."""
        if not self.aliased:
            self.flat = self.gathered()
            if self.master_is_params:
                self.master = self.flat[self.start:self.stop]

    def store(self) -> None:
        """xla, after the write-back: the flat buffer -> the parameters, and let it go."""
        if not self.aliased:
            for p, off in zip(self.params, self.offsets):
                p.data.copy_(self.flat[off:off + p.numel()].view_as(p))
            self.flat, self.master = None, (None if self.master_is_params else self.master)

    def flatten(self, tensors, dtype) -> torch.Tensor:
        """Concatenate tensors (as dtype) and zero-pad to the sharded length."""
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        pad = self.padded - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


class FlatAdamW:
    """AdamW over this rank's flat buffers; `step` = the four phases (module docstring)."""

    def __init__(self, model, mesh, tcfg, device, strategy=None):
        self.mesh, self.tcfg, self.device = mesh, tcfg, device
        self.zero, self.precision = tcfg.zero >= 1, tcfg.precision
        self.exact = device.kind != "xla"      # the grad norm's squares summed in fp64 (trn1 has no fp64)
        # the one place data parallelism enters: all-reduce everything, or ZeRO-1's shards (`strategy`:
        # another class with ReplicatedDP's methods, a seam: docs/design.md 1); overlapped with the
        # backward (not on XLA: its compiler schedules collectives)
        strategy = strategy or (zero1.ZeroOneDP if self.zero else data_parallel.ReplicatedDP)
        overlap = tcfg.overlap_grad_reduce and device.kind != "xla"
        self.dp = strategy(mesh.grad_group, int(tcfg.bucket_mb * 2**20 / 4), tcfg.microbatches, overlap)
        # a parameter cut over another group of ranks than tp (p.shard.group: a mixture's experts, each
        # held by some of the dp ranks under expert parallelism) has its gradient summed over the ranks
        # holding the same part, the mesh's group '<that group>_dp', the same way
        by_kind, strategies = {}, {"tp": self.dp}
        for name, p in model.named_parameters():
            group = p.shard.group
            if group not in strategies:
                strategies[group] = strategy(mesh.group(group + "_dp"), self.dp.bucket_elems,
                                             tcfg.microbatches, overlap)
            # a flat buffer per (the strategy's unit, decay, tp-replicated, parts, group)
            key = (self.dp.unit_of(name), p.ndim >= 2, p.shard.dim is None, p.shard.parts, group)
            by_kind.setdefault(key, ([], []))[0].append(name)
            by_kind[key][1].append(p)
        kinds = sorted(by_kind.items(), reverse=True)   # (in the same order on every rank)
        self.groups = [FlatGroup(names, params, decay, repl, strategies[split], master_dtype(tcfg.precision),
                                 moment_dtype(tcfg.moments), device.torch_device, mesh.tp_rank, mesh.tp)
                       for (_, decay, repl, _, split), (names, params) in kinds]
        for g in self.groups:   # how each parameter's gradient reaches g.grad (a seam: docs/design.md 1)
            self.attach(g)
        # steps taken (for the bias corrections; a skipped step does not count), on the device
        self.step_count = torch.zeros((), dtype=torch.int64, device=device.torch_device)
        # what else a step updates that is not a parameter: each hook(finite) runs after the update, on
        # every rank (a seam: docs/design.md 1)
        self.step_hooks = []

    def attach(self, g: FlatGroup) -> None:
        """Each parameter's hook (the DP strategy's `grad_hook`) adds its gradient into g.grad, frees it."""
        for p, off in zip(g.params, g.offsets):
            p.register_post_accumulate_grad_hook(g.dp.grad_hook(g.dp_state, off, p.numel()))

    def zero_grad(self) -> None:
        """Start a step's gradient accumulation: clear the fp32 buffers."""
        for g in self.groups:
            g.grad.zero_()
            if g.dp_state.watch is not None:
                g.dp_state.watch.reset()
            for p in g.params:
                p.grad = None

    def step(self, lr: float, loss_finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The four phases, in order, as train.py calls them. Returns (norm, finite) on the device."""
        grads = self.reduce_gradients()
        norm = self.global_grad_norm(grads)
        finite = torch.isfinite(norm) if loss_finite is None else torch.isfinite(norm) & loss_finite
        self.update(grads, lr, norm, finite)
        self.write_back()
        return norm, finite

    @torch.no_grad()
    def reduce_gradients(self) -> list[torch.Tensor]:
        """Phase 1: each group's flat fp32 gradient, summed over dp (all of it, or this rank's shard), and
        over tp where its tp ranks hold partial sums (FlatGroup.partial): first, or after (on the shard)
        where the strategy summed over dp in the backward (dp.in_backward)."""
        grads = []
        for g in self.groups:
            def tp_sum(flat):
                return comm.all_reduce(flat, self.mesh.group(g.partial), inplace=True) if g.partial else flat
            grads.append(tp_sum(g.dp.reduce_gradients(g.dp_state, g.grad)) if g.dp.in_backward
                         else g.dp.reduce_gradients(g.dp_state, tp_sum(g.grad)))
        return grads

    @torch.no_grad()
    def global_grad_norm(self, grads) -> torch.Tensor:
        """Phase 2: the gradient norm of the whole model, each parameter counted once (module docstring)."""
        mesh, sq = self.mesh, torch.zeros((), dtype=torch.float64 if self.exact else torch.float32,
                                          device=self.device.torch_device)
        spread: dict = {}                                # cut over another group than tp (experts): by group
        for g, grad in zip(self.groups, grads):
            spec = g.params[0].shard
            s, copies = self._sum_of_squares(grad), mesh.tp // spec.parts
            if spec.group != "tp":
                spread[spec.group] = spread.get(spec.group, torch.zeros_like(sq)) + s
            else:                                        # (copies: tp ranks holding this group's elements)
                sq = sq + (s / copies if copies > 1 else s)
        sq = sq.float()
        # each rank of such a group holds other parts (other experts): add them up over it (under ZeRO the sum
        # over dp below does, its ranks holding every part's shards once)
        for name, s in spread.items():
            if not self.zero:
                s = comm.all_reduce(s.float(), mesh.group(name))
            sq = sq + s.float() / mesh.tp                # (whole on every tp rank: counted once over tp)
        sq = comm.all_reduce(sq, mesh.tp_group)
        sq = comm.all_reduce(sq, mesh.pp_group)
        return self.dp.sum_norm_squares(sq).sqrt()

    def _sum_of_squares(self, grad):   # (tools/fast_adamw.py: chunked, or compiled)
        return sum_of_squares(grad, self.exact)

    @torch.no_grad()
    def update(self, grads, lr: float, norm: torch.Tensor, finite: torch.Tensor) -> None:
        """Phase 3: clip and AdamW on the master (ZeRO: this rank's shard of it).

        A non-finite step must change nothing, and on XLA an `if` on a device value
        would be a host sync. So the update always runs, and `keep` (1.0, or 0.0 when
        not `finite`) multiplies every change: moment weights, lr, decay, gradient."""
        tcfg, keep = self.tcfg, finite.float()
        b1, b2 = tcfg.beta1, tcfg.beta2
        lr_t = torch.tensor(lr, dtype=torch.float32, device=self.device.torch_device)
        n = (self.step_count + 1).float()                # this step's number, if it is kept
        # bias corrections 1 - beta^n, as -expm1(n log beta): accurate in fp32 even for n = 1
        bc1, bc2 = -torch.expm1(n * math.log(b1)), -torch.expm1(n * math.log(b2))
        clip = torch.clamp(tcfg.grad_clip / (norm + 1e-6), max=1.0) if tcfg.grad_clip > 0 else 1.0
        c = {"clip": clip * keep,
             "w1": (1 - b1) * keep, "w2": (1 - b2) * keep,   # moment weights: m <- m + w1 (g - m)
             "step_size": lr_t * keep / bc1, "sqrt_bc2": bc2.sqrt(),
             "decay": 1 - lr_t * keep * tcfg.weight_decay}       # decoupled weight decay: w <- w (1 - lr wd)
        for g, grad in zip(self.groups, grads):   # AdamW in fp32 (.float() of an fp32 tensor is itself)
            g.load()                                     # (xla: the flat buffer, gathered in-graph)
            w, m, v = g.master.float(), g.exp_avg.float(), g.exp_avg_sq.float()
            self._adamw(grad, m, v, w, c, g.decay and tcfg.weight_decay != 0)
            for stored, new, salt in ((g.master, w, 0), (g.exp_avg, m, 1), (g.exp_avg_sq, v, 2)):
                if new is not stored:   # bf16: round the fp32 result back (noise salted by buffer)
                    round_into_master(stored, new, g.pieces, self.precision, tcfg.seed, self.step_count + 1,
                                      salt)
            del w, m, v                                  # (free the fp32 copies before the next group)
        self.step_count += finite.long()                 # a skipped step is not a step
        for hook in self.step_hooks:
            hook(finite)

    def _adamw(self, grad, m, v, w, c: dict, decay: bool) -> None:
        """AdamW (Loshchilov & Hutter 2019) on flat buffers, in place (a full-size temporary
        of a 7B model is gigabytes; the gradient buffer is the scratch space), each line's
        textbook form beside it. tools/fast_adamw.py runs it block by block, or compiled."""
        grad.mul_(c["clip"]).nan_to_num_(0.0, 0.0, 0.0)     # g <- clip g (a skipped step's inf/nan: 0)
        m.lerp_(grad, c["w1"])                              # m <- m + (1 - b1)(g - m) = b1 m + (1 - b1) g
        v.lerp_(grad.mul_(grad), c["w2"])                   # v <- b2 v + (1 - b2) g^2 (grad now holds g^2)
        denom = torch.sqrt(v, out=grad).div_(c["sqrt_bc2"]).add_(self.tcfg.adam_eps)   # sqrt(v / bc2) + eps
        update = torch.div(m, denom, out=denom).mul_(c["step_size"])   # lr (m / bc1) / (sqrt(v / bc2) + eps)
        if decay:
            w.mul_(c["decay"])                              # w <- w (1 - lr wd): decoupled weight decay
        w.sub_(update)                                      # w <- w - lr (m / bc1) / (sqrt(v / bc2) + eps)

    @torch.no_grad()
    def write_back(self) -> None:
        """Phase 4: the new master -> the model's parameters (ZeRO-1: all-gather the shards first).
        Without ZeRO-1 a master that is the parameter buffer was already written by `update`."""
        for g in self.groups:
            if self.zero or not g.master_is_params:
                g.dp.write_back(g)                    # (as the DP strategy does it)
            g.store()                                    # (xla: the flat buffer -> the parameters)
