"""AdamW over flat buffers, the learning-rate schedule, and the global grad norm.

One optimizer serves every layout. The parameters of this rank are packed
into flat buffers, one per *group*: (weight-decayed or not) x (sharded over tp
or replicated). Per buffer the optimizer keeps a master copy and the two Adam
moments, for all of it (plain data parallel) or for this dp rank's 1/dp shard
(--zero1, see zero1.py). A step:

    grads -> flat fp32 -> dp all-reduce (or ZeRO-1 reduce-scatter)
          -> global grad norm -> clip -> AdamW on the (shard of the) master
          -> (ZeRO-1 all-gather) -> copy into the model's parameters

The global grad norm (DESIGN 5.4) must count every parameter exactly once:
  * tp-sharded weights: each tp rank holds different elements -> sum over tp;
  * tp-replicated weights (the RMSNorm gains) are identical on all tp ranks ->
    each rank adds 1/tp of their square, so the sum over tp counts them once;
    likewise kv heads shared by r tp ranks (tp > n_kv_heads): 1/r each;
  * pipeline stages hold disjoint layers -> sum over pp;
  * dp replicas hold the same gradients after the all-reduce -> count once,
    except under ZeRO-1, where each dp rank holds a different shard -> sum over dp.
Get any of these wrong and clipping silently differs between layouts.

Every step-dependent scalar (lr, bias corrections) enters as a tensor so an
XLA graph does not change (and recompile) from one step to the next, and a
non-finite gradient or loss turns the update into a no-op (multiplied by 0.0), not an `if`.
"""

from __future__ import annotations

import math

import torch

from . import comm, data_parallel, zero1
from .precision import master_dtype, round_update


def cosine_lr(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `total` steps (step counts from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


class FlatGroup:
    """One flat buffer of parameters and its (shard of) optimizer state."""

    def __init__(self, names, params, decay: bool, tp_replicated: bool, dp: int, dp_rank: int,
                 zero: bool, mdtype, device):
        self.names, self.params = names, params
        self.decay, self.tp_replicated = decay, tp_replicated
        self.numel = sum(p.numel() for p in params)
        self.shards = dp if zero else 1
        self.padded = zero1.padded_size(self.numel, self.shards)
        self.start, self.stop = zero1.shard_range(self.numel, self.shards, dp_rank if zero else 0)
        self.offsets = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        flat = self.flatten([p.detach() for p in params], torch.float32)
        self.master = flat[self.start:self.stop].to(mdtype).clone()
        self.exp_avg = torch.zeros(self.stop - self.start, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self._grad = None

    def flatten(self, tensors, dtype) -> torch.Tensor:
        """Concatenate tensors (as dtype) and zero-pad to the sharded length."""
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        pad = self.padded - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def grad_buffer(self) -> torch.Tensor:
        """The parameters' gradients copied into one flat, padded fp32 buffer,
        kept between steps (it is also the optimizer step's scratch space)."""
        if self._grad is None:
            self._grad = torch.zeros(self.padded, dtype=torch.float32, device=self.master.device)
        for p, off in zip(self.params, self.offsets):
            if p.grad is None:
                self._grad[off:off + p.numel()].zero_()
            else:
                self._grad[off:off + p.numel()].copy_(p.grad.reshape(-1))
        return self._grad

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))


class FlatAdamW:
    def __init__(self, model, mesh, train, device):
        self.mesh, self.train = mesh, train
        self.zero = train.zero1
        self.precision = train.precision
        self.software_sr = not device.hardware_stochastic_rounding   # trn1 rounds stochastically in hardware
        self.bucket_elems = int(train.bucket_mb * 2**20 / 4)
        mdtype = master_dtype(train.precision)
        by_kind: dict = {}
        for name, p in model.named_parameters():
            key = (p.ndim >= 2, p.tp_dim is None, p.tp_parts)   # (decay, tp-replicated, parts over tp)
            by_kind.setdefault(key, ([], []))
            by_kind[key][0].append(name)
            by_kind[key][1].append(p)
        self.groups = [FlatGroup(names, params, decay, repl, mesh.dp, mesh.dp_rank, self.zero, mdtype,
                                 device.torch_device)
                       for (decay, repl, _), (names, params) in sorted(by_kind.items(), reverse=True)]
        self.step_count = 0
        self.device = device
        self.sr_generator = None
        if self.software_sr and train.precision == "bf16-sr" and device.kind != "xla":
            # SR noise need not match across layouts (each rank rounds its own shard).
            # torch_xla has no torch.Generator: on xla the noise comes from XLA's own RNG.
            self.sr_generator = torch.Generator(device=device.torch_device).manual_seed(train.seed + 1000 + mesh.rank)

    def state_bytes(self) -> int:
        """Optimizer memory on this rank: master weights (if separate) + two moments."""
        return sum(g.state_bytes() for g in self.groups)

    def zero_grad(self) -> None:
        for g in self.groups:
            for p in g.params:
                p.grad = None

    @torch.no_grad()
    def step(self, lr: float, loss_finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step. Returns (grad norm, finite flag) as device tensors (no host sync).

        A step whose gradient norm (or, given `loss_finite`, loss) is not finite
        changes nothing: every update below is multiplied by `keep` = 0.0.
        Buffers are updated in place: on a 7B model each full-size temporary
        would be gigabytes, and on CPU every fresh one costs page faults.
        """
        mesh, t = self.mesh, self.train
        dev = self.device.torch_device
        self.step_count += 1
        b1, b2 = t.beta1, t.beta2
        # step-dependent scalars as one small tensor: the graph stays the same every step
        scalars = torch.tensor([lr, 1 - b1 ** self.step_count, 1 - b2 ** self.step_count],
                               dtype=torch.float32, device=dev)
        lr_t, bc1, bc2 = scalars[0], scalars[1], scalars[2]

        # 1. gradients -> this group's flat fp32 buffer, summed over dp (all of it, or this rank's shard)
        grads = []
        for g in self.groups:
            flat = g.grad_buffer()
            if g.tp_replicated and mesh.tp > 1 and any(p.sequence_parallel for p in g.params):
                # sequence-parallel norms saw only their rank's tokens: add the partial grads
                flat = comm.all_reduce(flat, mesh.tp_group, inplace=True)
            if self.zero:
                grads.append(data_parallel.reduce_scatter_buckets(flat, mesh.dp_group, self.bucket_elems))
            else:
                grads.append(data_parallel.all_reduce_buckets(flat, mesh.dp_group, self.bucket_elems))

        # 2. global grad norm, each parameter counted once (see module docstring)
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        for g, grad in zip(self.groups, grads):
            s = torch.linalg.vector_norm(grad).square()
            copies = mesh.tp // g.params[0].tp_parts    # tp ranks holding this group's elements
            sq = sq + (s / copies if copies > 1 else s)
        sq = comm.all_reduce(sq, mesh.tp_group)
        sq = comm.all_reduce(sq, mesh.pp_group)
        if self.zero:
            sq = comm.all_reduce(sq, mesh.dp_group)
        norm = sq.sqrt()
        finite = torch.isfinite(norm) if loss_finite is None else torch.isfinite(norm) & loss_finite
        keep = finite.float()                            # 0.0 turns the whole update into a no-op
        clip = torch.clamp(t.grad_clip / (norm + 1e-6), max=1.0) if t.grad_clip > 0 else torch.ones_like(norm)
        clip = clip * keep
        w1, w2 = (1 - b1) * keep, (1 - b2) * keep        # moment weights: m <- m + w1 (g - m)
        step_size = lr_t * keep / bc1
        decay = 1 - lr_t * keep * t.weight_decay         # decoupled weight decay: w <- w (1 - lr wd)

        # 3. AdamW on the master shard, in fp32, reusing the gradient buffer as scratch
        for g, grad in zip(self.groups, grads):
            grad.mul_(clip).nan_to_num_(0.0, 0.0, 0.0)   # a skipped step's inf/nan become 0 x ... = 0
            g.exp_avg.lerp_(grad, w1)
            g.exp_avg_sq.lerp_(grad.mul_(grad), w2)
            denom = torch.sqrt(g.exp_avg_sq, out=grad).div_(bc2.sqrt()).add_(t.adam_eps)
            update = torch.div(g.exp_avg, denom, out=denom).mul_(step_size)   # (m / bc1) / (sqrt(v / bc2) + eps)
            w = g.master if g.master.dtype == torch.float32 else g.master.float()
            if g.decay and t.weight_decay:
                w.mul_(decay)
            w.sub_(update)
            if w is not g.master:                        # pure bf16: round the fp32 result back
                g.master.copy_(round_update(w, g.master.dtype, self.precision, self.software_sr,
                                            self.sr_generator))

            # 4. back into the model: all-gather the shards (ZeRO-1) and unflatten
            full = g.master.to(g.params[0].dtype)
            if self.zero:
                full = data_parallel.all_gather_buckets(full, mesh.dp_group, self.bucket_elems)
            for p, off in zip(g.params, g.offsets):
                p.copy_(full[off:off + p.numel()].view_as(p))
        return norm, finite

    # -- checkpoint support: per-parameter pieces of the (sharded) state --

    def export_state(self) -> dict:
        """{name: {start, stop, master, exp_avg, exp_avg_sq}} where [start, stop)
        indexes this rank's tp-local parameter flattened; ZeRO-1 ranks each
        export the piece of every parameter that falls in their shard."""
        out = {}
        for g in self.groups:
            for name, p, off in zip(g.names, g.params, g.offsets):
                ov = zero1.overlap(off, off + p.numel(), g.start, g.stop)
                if ov is None:
                    continue
                a, b = ov[0] - g.start, ov[1] - g.start
                out[name] = {"start": ov[0] - off, "stop": ov[1] - off,
                             "master": g.master[a:b].float(), "exp_avg": g.exp_avg[a:b],
                             "exp_avg_sq": g.exp_avg_sq[a:b]}
        return out

    @torch.no_grad()
    def import_state(self, local_flat, step_count: int) -> None:
        """Fill this rank's shards from `local_flat(name, key)` -> the tp-local
        parameter's full flattened state (key: master | exp_avg | exp_avg_sq)."""
        self.step_count = step_count
        for g in self.groups:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                dst = getattr(g, key)
                flat = g.flatten([local_flat(n, key) for n in g.names], torch.float32)
                dst.copy_(flat[g.start:g.stop].to(dst.dtype))
