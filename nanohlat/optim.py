"""AdamW over flat buffers, the learning-rate schedule, and the global grad norm.

One optimizer serves every layout. The parameters of this rank are packed
into flat buffers, one per *group*: (weight-decayed or not) x (sharded over tp
or replicated). Per buffer the optimizer keeps the gradients (fp32, added in
by a hook as autograd makes each micro-batch's), a master copy and the two
Adam moments, the last three for all of it (plain data parallel) or for this
dp rank's 1/dp shard (--zero1, see zero1.py). A step:

    1. reduce gradients   flat fp32 grads -> dp all-reduce (or ZeRO-1 reduce-scatter)
    2. global grad norm    one number over all ranks, each parameter counted once
    3. AdamW update        clip, then plain AdamW on the (shard of the) master
    4. write back          (ZeRO-1 all-gather) -> copy into the model's parameters

Where data parallelism enters (steps 1, 2 and 4) the optimizer calls one
object: `data_parallel.ReplicatedDP`, or `zero1.ZeroOneDP` with --zero1.

The global grad norm (docs/design.md 5.4) must count every parameter exactly once:
  * tp-sharded weights: each tp rank holds different elements -> sum over tp;
  * tp-replicated weights (the RMSNorm gains) are identical on all tp ranks ->
    each rank adds 1/tp of their square, so the sum over tp counts them once;
    likewise kv heads shared by r tp ranks (tp > n_kv_heads): 1/r each;
  * pipeline stages hold disjoint layers -> sum over pp;
  * dp replicas hold the same gradients after the all-reduce -> count once,
    except under ZeRO-1, where each dp rank holds a different shard -> sum over dp.
Get any of these wrong and clipping silently differs between layouts.

Every rank that holds a copy of an element (dp replicas, tp-replicated
norms) computes the same update for it, bit for bit: the same reduced
gradient, the same norm, and in bf16-sr the same rounding noise (a function
of the element, not of the rank: precision.py). `--check-replicas` checks it.

Every step-dependent scalar (lr, the step count for the bias corrections)
is a tensor so an XLA graph does not change (and recompile) from one step to
the next, and a non-finite gradient or loss turns the update into a no-op
(multiplied by 0.0, see FlatAdamW.step), not an `if`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from . import comm, data_parallel, zero1
from .precision import (full_index, master_dtype, mix64, name_key, round_update, rounding_noise, step_key,
                        stochastic_round_to_bf16)


def cosine_lr(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `total` steps (step counts from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


# On the CPU the optimizer's passes over its big flat buffers are memory-bound:
# one pass over a 13.8M-element buffer streams 55 MB from RAM, and AdamW makes
# about a dozen. Done block by block, each block's dozen passes find it still in
# the cache (what a fused kernel does in one loop): about twice as fast. A block
# is 2 MiB of fp32 per buffer, 8 MiB for the four buffers AdamW touches, within
# a laptop's L3 cache. GPUs stream memory fast and pay per kernel launch, and XLA
# fuses the passes itself: both take whole buffers (`block_size`).
CPU_BLOCK = 1 << 19


def block_size(device_kind: str) -> int | None:
    """Elements per block of the optimizer's passes on this device; None: whole buffers."""
    return CPU_BLOCK if device_kind == "cpu" else None


def blocks(n: int, size: int | None) -> list[slice]:
    """[0, n) in consecutive slices of `size` elements (one slice when size is None)."""
    size = size or max(n, 1)
    return [slice(a, min(a + size, n)) for a in range(0, n, size)] or [slice(0, 0)]


def sum_of_squares(x: torch.Tensor, exact: bool, block: int | None = None) -> torch.Tensor:
    """sum(x^2) of a flat fp32 buffer.

    The grad norm decides the clipping, so the layouts' norms must agree as
    well as their gradients do (per parameter, to ~1e-9 relative). An fp32
    reduction of a million squares adds its own round-off of ~1e-5 relative,
    larger than that. So `exact` (cpu, cuda) accumulates in fp64, a block at a
    time (a full fp64 copy of the buffer would double its memory; on the CPU a
    cache-sized block is also faster): each square is exact in fp64 and the
    sum's round-off is ~1e-16 per addition. XLA devices (trn1 has no fp64) use
    fp32 dot products, which the compiler sums as a tree.
    """
    if not exact:
        return torch.dot(x, x)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for sl in blocks(x.numel(), block or 1 << 20):
        c = x[sl].double()
        total += torch.dot(c, c)
    return total


def fused_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) in fp64, written for torch.compile (FlatAdamW.compile): Inductor
    turns it into one loop that squares and adds each element in fp64, with no
    fp64 copy. Run eagerly, `x.double()` would be a full fp64 copy of x."""
    return x.double().square().sum()


class FlatGroup:
    """One flat buffer of parameters and its (shard of) optimizer state."""

    def __init__(self, names, params, decay: bool, tp_replicated: bool, dp_sync, mdtype, device, tp_rank=0, tp=1):
        self.names, self.params = names, params
        self.decay, self.tp_replicated = decay, tp_replicated
        self.numel = sum(p.numel() for p in params)
        self.padded, self.start, self.stop = dp_sync.layout(self.numel)
        self.offsets = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.pieces = self._pieces(tp_rank, tp)
        flat = self.flatten([p.detach() for p in params], torch.float32)
        self.master = flat[self.start:self.stop].to(mdtype).clone()
        self.exp_avg = torch.zeros(self.stop - self.start, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        # the gradients, accumulated in fp32 micro-batch by micro-batch (FlatAdamW's
        # hooks), summed over dp in place, then the AdamW update's scratch space
        self.grad = torch.zeros(self.padded, dtype=torch.float32, device=device)

    def _pieces(self, tp_rank: int, tp: int) -> list:
        """Each parameter's part of this rank's shard [start, stop), with what
        the stochastic-rounding noise needs to name its elements."""
        pieces = []
        for name, p, off in zip(self.names, self.params, self.offsets):
            ov = zero1.overlap(off, off + p.numel(), self.start, self.stop)
            if ov is None:
                continue
            chunks = p.shard.parts
            pieces.append(SimpleNamespace(
                name=name, name_key=name_key(name), start=ov[0] - self.start, stop=ov[1] - self.start,
                local_start=ov[0] - off, local_stop=ov[1] - off, shape=tuple(p.shape), tp_dim=p.shard.dim,
                chunks=chunks, chunk=tp_rank * chunks // tp))   # tp ranks that share a chunk hold copies
        return pieces

    def accumulate_hook(self, off: int, numel: int):
        """A post-accumulate-grad hook for the parameter at `off`: add its fresh
        gradient (one micro-batch's, in the parameter's dtype) into the fp32
        buffer and free it, so no gradient is ever summed in bf16."""
        view = self.grad[off:off + numel]

        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                view.add_(p.grad.reshape(-1))
                p.grad = None
        return hook

    def flatten(self, tensors, dtype) -> torch.Tensor:
        """Concatenate tensors (as dtype) and zero-pad to the sharded length."""
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        pad = self.padded - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))


class FlatAdamW:
    def __init__(self, model, mesh, tcfg, device):
        self.mesh, self.tcfg = mesh, tcfg
        self.zero = tcfg.zero1
        self.precision = tcfg.precision
        self.software_sr = not device.hardware_stochastic_rounding   # trn1 rounds stochastically in hardware
        bucket_elems = int(tcfg.bucket_mb * 2**20 / 4)
        # the one place data parallelism enters: all-reduce everything, or ZeRO-1's shards
        self.dp_sync = (zero1.ZeroOneDP if self.zero else data_parallel.ReplicatedDP)(mesh.dp_group, bucket_elems)
        mdtype = master_dtype(tcfg.precision)
        by_kind: dict = {}
        for name, p in model.named_parameters():
            key = (p.ndim >= 2, p.shard.dim is None, p.shard.parts)   # (decay, tp-replicated, parts over tp)
            by_kind.setdefault(key, ([], []))
            by_kind[key][0].append(name)
            by_kind[key][1].append(p)
        self.groups = [FlatGroup(names, params, decay, repl, self.dp_sync, mdtype, device.torch_device,
                                 mesh.tp_rank, mesh.tp)
                       for (decay, repl, _), (names, params) in sorted(by_kind.items(), reverse=True)]
        for g in self.groups:
            for p, off in zip(g.params, g.offsets):
                p.register_post_accumulate_grad_hook(g.accumulate_hook(off, p.numel()))
        # optimizer steps taken, as a device tensor: a skipped (non-finite) step
        # does not count (Adam's bias correction), and XLA needs no host sync for it
        self.step_count = torch.zeros((), dtype=torch.int64, device=device.torch_device)
        self.device = device
        self.block = block_size(device.kind)   # the passes' block size (CPU_BLOCK above)
        self.exact = device.kind != "xla"      # the grad norm in fp64 (sum_of_squares); trn1 has no fp64
        self.squares = lambda x: sum_of_squares(x, self.exact, self.block)   # phase 2's sum(g^2) of one buffer

    def compile(self) -> None:
        """--compile: torch.compile the step's arithmetic, not its collectives:
        phase 2's sum of squares and phase 3's AdamW, each fused by Inductor
        into one loop over a whole buffer (so no cache blocks: one pass reads
        each element once). One graph per buffer size (dynamic=False).
        build.py calls it with --compile (compile.py says what stays eager)."""
        self.block = None
        self.squares = torch.compile(fused_sum_of_squares, dynamic=False)
        self._adamw_block = torch.compile(self._adamw_block, dynamic=False)

    def state_bytes(self) -> int:
        """Optimizer memory on this rank: master weights (if separate) + two moments."""
        return sum(g.state_bytes() for g in self.groups)

    def zero_grad(self) -> None:
        """Start a step's gradient accumulation: clear the fp32 buffers."""
        for g in self.groups:
            g.grad.zero_()
            for p in g.params:
                p.grad = None

    @torch.no_grad()
    def step(self, lr: float, loss_finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step, in four phases. Returns (grad norm, finite flag)
        as device tensors (no host sync).

        The "keep" mask. A step whose gradient norm (or, given `loss_finite`,
        loss) is not finite must change nothing, and on XLA that cannot be a
        Python `if` on a device value (a host sync every step). So the step
        always runs, and `keep` (1.0, or 0.0 for such a step) multiplies every
        change it makes: the moments' weights, the learning rate, the weight
        decay, the clipped gradient. With keep = 0.0 each buffer is rewritten
        with its old value. This is the only place the mask is made.
        """
        grads = self._reduce_gradients()                        # 1. sum the gradients over tp (SP) and dp
        norm = self._global_grad_norm(grads)                    # 2. one number for the whole model
        finite = torch.isfinite(norm) if loss_finite is None else torch.isfinite(norm) & loss_finite
        keep = finite.float()                                   # 0.0 turns the whole update into a no-op
        coef = self._coefficients(lr, norm, keep)
        for g, grad in zip(self.groups, grads):
            self._adamw(g, grad, coef)                          # 3. AdamW on the (shard of the) master
            self._write_back(g)                                 # 4. into the model's parameters
        self.step_count += finite.long()                        # a skipped step is not a step
        return norm, finite

    def _reduce_gradients(self) -> list[torch.Tensor]:
        """Phase 1: each group's flat fp32 gradient, summed over dp (all of it, or this rank's shard)."""
        grads = []
        for g in self.groups:
            flat = g.grad
            if g.tp_replicated and self.mesh.tp > 1 and any(p.shard.sequence_parallel for p in g.params):
                # sequence-parallel norms saw only their rank's tokens: add the partial grads
                flat = comm.all_reduce(flat, self.mesh.tp_group, inplace=True)
            grads.append(self.dp_sync.reduce_gradients(flat))
        return grads

    def _global_grad_norm(self, grads) -> torch.Tensor:
        """Phase 2: the gradient norm of the whole model, each parameter counted once (module docstring)."""
        mesh = self.mesh
        sq = torch.zeros((), dtype=torch.float64 if self.exact else torch.float32, device=self.device.torch_device)
        for g, grad in zip(self.groups, grads):
            s = self.squares(grad)
            copies = mesh.tp // g.params[0].shard.parts    # tp ranks holding this group's elements
            sq = sq + (s / copies if copies > 1 else s)
        sq = sq.float()                                  # 4 bytes per all-reduce below
        sq = comm.all_reduce(sq, mesh.tp_group)
        sq = comm.all_reduce(sq, mesh.pp_group)
        return self.dp_sync.sum_norm_squares(sq).sqrt()

    def _coefficients(self, lr: float, norm: torch.Tensor, keep: torch.Tensor) -> dict:
        """This step's scalars as device tensors, every one multiplied by `keep`.
        Step-dependent values enter as tensors so the XLA graph stays the same every step."""
        tcfg = self.tcfg
        b1, b2 = tcfg.beta1, tcfg.beta2
        lr_t = torch.tensor(lr, dtype=torch.float32, device=self.device.torch_device)
        n = (self.step_count + 1).float()                # this step's number, if it is kept
        # bias corrections 1 - beta^n, as -expm1(n log beta): accurate in fp32 even for n = 1
        bc1, bc2 = -torch.expm1(n * math.log(b1)), -torch.expm1(n * math.log(b2))
        clip = torch.clamp(tcfg.grad_clip / (norm + 1e-6), max=1.0) if tcfg.grad_clip > 0 else torch.ones_like(norm)
        return {"clip": clip * keep,
                "w1": (1 - b1) * keep, "w2": (1 - b2) * keep,   # moment weights: m <- m + w1 (g - m)
                "step_size": lr_t * keep / bc1, "sqrt_bc2": bc2.sqrt(),
                "decay": 1 - lr_t * keep * tcfg.weight_decay}       # decoupled weight decay: w <- w (1 - lr wd)

    def _adamw(self, g: FlatGroup, grad: torch.Tensor, c: dict) -> None:
        """Phase 3: plain AdamW (Loshchilov & Hutter 2019) on the master, in fp32,
        block by block (`blocks`: on the CPU each block stays in the cache
        through all of its passes; elsewhere one block is the whole buffer)."""
        w = g.master if g.master.dtype == torch.float32 else g.master.float()
        decay = g.decay and self.tcfg.weight_decay != 0
        for sl in blocks(w.numel(), self.block):
            self._adamw_block(grad[sl], g.exp_avg[sl], g.exp_avg_sq[sl], w[sl], c, decay)
        if w is not g.master:                               # pure bf16: round the fp32 result back
            self._round_into_master(g, w)

    def _adamw_block(self, grad, m, v, w, c: dict, decay: bool) -> None:
        """AdamW on one block of the gradient, the two moments m, v and the weights w:

            g <- clip * g
            m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
            w <- w (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)

        with bc = 1 - beta^step (bias correction), written in place (on a 7B
        model each full-size temporary would be gigabytes, and on CPU every
        fresh one costs page faults): the gradient buffer is the scratch space.
        """
        grad.mul_(c["clip"]).nan_to_num_(0.0, 0.0, 0.0)    # a skipped step's inf/nan become 0 x ... = 0
        m.lerp_(grad, c["w1"])
        v.lerp_(grad.mul_(grad), c["w2"])
        denom = torch.sqrt(v, out=grad).div_(c["sqrt_bc2"]).add_(self.tcfg.adam_eps)
        update = torch.div(m, denom, out=denom).mul_(c["step_size"])   # (m / bc1) / (sqrt(v / bc2) + eps)
        if decay:
            w.mul_(c["decay"])
        w.sub_(update)

    def _round_into_master(self, g: FlatGroup, w: torch.Tensor) -> None:
        """Pure bf16: store the fp32 result `w` in the bf16 master. bf16-sr in
        software rounds each element with its own noise, a function of (seed,
        step, parameter, the element's index in the full parameter) and not of
        the rank (precision.py), so every replica of an element rounds alike."""
        if not (self.precision == "bf16-sr" and self.software_sr):
            g.master.copy_(round_update(w, g.master.dtype, self.precision, self.software_sr))
            return
        key = step_key(self.tcfg.seed, self.step_count + 1)
        for p in g.pieces:   # one parameter's part of this rank's shard at a time: small int64 temporaries
            local = torch.arange(p.local_start, p.local_stop, dtype=torch.int64, device=w.device)
            noise = rounding_noise(mix64(key ^ p.name_key), full_index(local, p.shape, p.tp_dim, p.chunk, p.chunks))
            g.master[p.start:p.stop].copy_(stochastic_round_to_bf16(w[p.start:p.stop], noise=noise))

    def _write_back(self, g: FlatGroup) -> None:
        """Phase 4: the new master -> the model's parameters (ZeRO-1: all-gather the shards first)."""
        full = self.dp_sync.gather_parameters(g.master.to(g.params[0].dtype))
        for p, off in zip(g.params, g.offsets):
            p.copy_(full[off:off + p.numel()].view_as(p))

    # -- checkpoint support: per-parameter pieces of the (sharded) state --

    def export_state(self) -> dict:
        """{name: {start, stop, master, exp_avg, exp_avg_sq}} where [start, stop)
        indexes this rank's tp-local parameter flattened; ZeRO-1 ranks each
        export the piece of every parameter that falls in their shard."""
        out = {}
        for g in self.groups:
            for p in g.pieces:
                a, b = p.start, p.stop
                out[p.name] = {"start": p.local_start, "stop": p.local_stop,
                               "master": g.master[a:b].float(), "exp_avg": g.exp_avg[a:b],
                               "exp_avg_sq": g.exp_avg_sq[a:b]}
        return out

    @torch.no_grad()
    def import_state(self, local_flat, step_count: int) -> None:
        """Fill this rank's shards from `local_flat(name, key)` -> the tp-local
        parameter's full flattened state (key: master | exp_avg | exp_avg_sq)."""
        self.step_count.fill_(step_count)
        for g in self.groups:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                dst = getattr(g, key)
                flat = g.flatten([local_flat(n, key) for n in g.names], torch.float32)
                dst.copy_(flat[g.start:g.stop].to(dst.dtype))
