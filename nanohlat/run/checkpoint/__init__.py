"""Sharded, atomic checkpoints that load into any layout.

On disk (one directory per saved step):

    <out_dir>/checkpoints/step_00000200/
        shard_00000.pt ... shard_<world-1>.pt   one per rank: its tensors + where they belong
        tokenizer.model                          a copy of the run's tokenizer (saving.py:_copy_tokenizer)
        manifest.json                            written last: config, layout, step, tokens,
                                                 schedule, data position, file sizes + sha256
    <out_dir>/checkpoints/latest                 name of the newest complete checkpoint

What a checkpoint holds, and why that is enough to resume bit-for-bit:
  * model weights and the optimizer's master weights and Adam moments (per
    parameter, so they can be reassembled in another layout);
  * the optimizer step count (Adam's bias corrections; skipped non-finite
    steps do not count) and the step itself:
    the learning rate is a pure function of (step, --lr, --min-lr,
    --warmup-steps, --steps), and the global batch of step k a pure function
    of (--seed, k) (docs/design.md 5.2), so "the data position" is just the step;
  * each rank's torch CPU generator, restored when the layout is unchanged
    (the stochastic-rounding noise needs no state: it is a function of the
    seed, the optimizer step and the element, precision.py);
  * the count of non-finite steps in a row (--max-bad-steps carries over).

One idea a module: history.py (which checkpoints a run has, its head, where
a run starts from), saving.py (the save protocol), background.py (the same
protocol written by a thread beside the steps: --async-save), optimizer_state.py (the
optimizer's state out of its flat buffers and back), manifest.py (trusting a
checkpoint before loading it), reshard.py (loading into any layout),
io_errors.py (a failed write as one line). The names callers outside use
are imported here: `from nanohlat.run import checkpoint; checkpoint.save(...)`.
"""

from __future__ import annotations

from nanohlat.run.checkpoint.history import (ckpt_root, clear_run, find_resume, incomplete_checkpoints, latest,
                                             list_checkpoints, resolve, step_of, warn_incomplete)
from nanohlat.run.checkpoint.manifest import check, check_identity, corrupt_files, note_model_changes, read_manifest
from nanohlat.run.checkpoint.reshard import ShardSet, load, load_buffers
from nanohlat.run.checkpoint.saving import save, save_full
