"""ZeRO stage 3: shard the parameters too (Rajbhandari et al. 2020, section 5.3;
PyTorch's FSDP is the same idea).

After ZeRO-2 a dp rank still keeps every parameter of its (pp, tp) slice
between steps, although it updates only its 1/dp of them. ZeRO-3 keeps only
that shard, and rebuilds a layer's full parameters just for the moments they
are used. The optimizer groups the parameters per *unit* (optim.FlatAdamW):
one per decoder layer, one for the rest (embedding, final norm, head); each
unit's flat buffers are sharded over dp as in ZeRO-1, and each parameter is
still a view of its flat buffer, whose storage is emptied between uses
(`untyped_storage().resize_(0)`: the views stay valid, they just hold no bytes
until the storage is given its size back and the shards all-gathered into it).

    forward of a layer:   all-gather its shards -> full buffer -> compute -> free it
    backward of a layer:  all-gather again (a hook on the layer's output fires
                          first) -> compute (full activation checkpointing
                          recomputes the layer's forward here, with the
                          buffer already whole) -> once the layer's last
                          gradient is in: reduce-scatter (ZeRO-2) -> free it
    optimizer step:       AdamW on the shard, which *is* the new weights: no
                          all-gather after it (the next forward's does it)
    between steps:        1/dp of the parameters, the gradients, the optimizer state

The rest unit is gathered for the whole forward and the whole backward of a
micro-batch (the embedding runs first, the head last): the price of one
simple unit. Each micro-batch gathers every unit twice, so per micro-batch a
rank sends 2 all-gathers of the parameters (in their dtype) and ZeRO-2's
reduce-scatter of the fp32 gradients: with fp32 parameters and one
micro-batch, 3 x (dp-1)/dp x 4 bytes per parameter, 1.5x plain data
parallelism's all-reduce (2 x (dp-1)/dp x 4). Memory bought with bandwidth.

Prefetch (starting the next unit's all-gather while this one computes) is
what makes this fast on a GPU or Trainium. On gloo over CPU processes it does
not pay (the all-gather and the compute take the same cores), so nanohlat
gathers each unit when it is needed and shows the simple schedule.

Not here: pipeline parallelism (a stage's micro-batches interleave forwards
and backwards of different units, and the units' hooks would have to follow
them) and XLA (one traced graph per step, where freeing a buffer's storage
means nothing): config.py and run/preflight.py refuse both in one line.
A mixture's experts under --ep are sharded over the ranks holding the same
ones (ep_dp), not over dp: each layer's experts are a second unit of that
layer, gathered and freed with it over their own group (`attach`).
Evaluation runs the same hooks; a checkpoint's export all-gathers each group
(`Unit.gathered`), its load and --check-replicas gather everything (`whole`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from nanohlat.zero1 import all_gather_buckets
from nanohlat.beyond.zero2 import Staging, ZeroTwoDP


class Shard(Staging):
    """ZeRO-3's own state for one flat group: ZeRO-2's, and the parameters kept as this rank's shard while the
    flat buffer's storage is empty (fp32, bf16, bf16-sr: also the master); gathers write through `fill`, an alias
    of that storage with a version counter of its own (the parameters, `.data` views, have theirs too: a write
    through flat.copy_ would be as safe for them)."""

    def __init__(self, g, watch):
        super().__init__(g, watch)
        self.flat, self.padded, self.start, self.stop, self.params = g.flat, g.padded, g.start, g.stop, g.params
        self.param_shard = g.flat[g.start:g.stop].clone()
        self.fill = g.flat.new_empty(0).set_(g.flat.untyped_storage(), 0, (g.padded,))
        self.unit = None                          # the Unit it is gathered and freed with (`attach`)


class ZeroThreeDP(ZeroTwoDP):
    """ZeRO-2's sharded gradients and update; the parameters kept as the shard (Shard.param_shard)."""

    state = Shard

    def grad_hook(self, s: Shard, off: int, numel: int):
        """ZeRO-2's hook, then: was this the unit's last gradient of the micro-batch? Free it."""
        hook = super().grad_hook(s, off, numel)

        def then_count(p: torch.Tensor) -> None:
            hook(p)
            s.unit.gradient_in()
        return then_count

    def unit_of(self, name: str) -> int:
        """Parameters are grouped per unit (its flat buffers gathered and freed together)."""
        return unit_of(name)

    def gathered(self, g) -> torch.Tensor:
        """Group g's whole flat buffer, all-gathered from every rank's shard."""
        return g.dp_state.unit.gathered(g.dp_state)

    def write_back(self, g) -> None:
        """Phase 4: the kept shard is the new weights (bf16-mixed: its fp32 master, rounded). No all-gather."""
        if not g.master_is_params:
            g.dp_state.param_shard.copy_(g.master)


class Unit:
    """The flat groups of one layer (or of the rest), their Shards gathered and freed together."""

    def __init__(self, shards, dp: ZeroThreeDP):
        self.shards, self.dp = shards, dp
        self.params = sum(len(s.params) for s in shards)   # gradients to wait for in a backward
        self.got, self.whole, self.in_backward = 0, True, False
        for s in shards:
            s.unit = self
        self.free()

    def gathered(self, s: Shard, group=None) -> torch.Tensor:
        """A group's whole flat buffer, all-gathered from every rank's shard (also a checkpoint's export)."""
        return all_gather_buckets(s.param_shard, group or self.dp.group, self.dp.bucket_elems)

    def gather(self, group=None) -> None:
        """Give each flat buffer its storage back and all-gather every rank's shard into it."""
        # exercise 3e: begin
        for s in self.shards if not self.whole else []:
            s.flat.untyped_storage().resize_(s.padded * s.flat.element_size())
            s.fill.copy_(self.gathered(s, group))
        self.whole = True
        # exercise 3e: end

    def free(self) -> None:
        """Keep only the shard: the parameters' views stay, their storage holds 0 bytes."""
        # exercise 3e: begin
        for s in self.shards:
            s.flat.untyped_storage().resize_(0)
        self.whole = False
        # exercise 3e: end

    def gradient_in(self) -> None:
        """A post-accumulate-grad hook fired: after the unit's last one its backward is over."""
        self.got += 1
        if self.got == self.params:
            self.got, self.in_backward = 0, False
            self.free()

    def attach(self, module: torch.nn.Module) -> None:
        """Gather before `module`'s forward; after it, free (but not in a backward's recompute)
        and hook its output, whose gradient comes just before the module's backward: gather."""
        module.register_forward_pre_hook(lambda mod, args: self.gather())

        def before_backward(grad):
            self.in_backward = True
            self.gather()

        def after(mod, args, out):
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(before_backward)
            if not self.in_backward:
                self.free()
        module.register_forward_hook(after)


def unit_of(name: str) -> int:
    """The unit of a parameter: its decoder layer, or -1 (embedding, final norm, head)."""
    return int(name.split(".")[1]) if name.startswith("layers.") else -1


def attach(model, groups) -> list:
    """One Unit per layer (and one for the rest) over FlatAdamW's groups' Shards, hooked to its module.
    A layer's experts under --ep, sharded over their own ranks (ep_dp, optim.py), are a second Unit
    of that layer, gathered and freed with it. Each Shard holds its Unit (Shard.unit)."""
    by_unit: dict = {}
    for g in groups:   # (each group's strategy: the dense parameters' over dp, the experts' over ep_dp)
        by_unit.setdefault((unit_of(g.names[0]), g.dp), []).append(g.dp_state)
    units = []
    for (u, strategy), shards in by_unit.items():
        units.append(Unit(shards, strategy))
        units[-1].attach(model if u < 0 else model.layers[str(u)])
    return units


@contextlib.contextmanager
def whole(opt, quiet: bool = False):
    """Every unit whole (a checkpoint's load, --check-replicas), then each rank keeps its shard of the result.
    quiet: gathered off the comm ledger (not training's traffic)."""
    units = list(dict.fromkeys(g.dp_state.unit for g in opt.groups))   # (each once, in the groups' order)
    for u in units:
        u.gather(dataclasses.replace(u.dp.group, ledger=None) if quiet else None)
    try:
        yield
    finally:
        for u in units:
            for s in u.shards:
                s.param_shard.copy_(s.flat[s.start:s.stop])
            u.free()

