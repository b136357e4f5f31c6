"""The recipe: the model's shape, the training run, and the presets.

Every command-line flag of train.py is a field of a `TrainConfig` or
`ModelConfig` (the flag `--seq-len` is the field `seq_len`), and `--preset`
picks the starting values. There are no hidden switches: what a run did is
fully described by the config it writes next to its metrics. This file holds
what the design card's training is made of: the model's shape, the batch,
AdamW, the layout and the precision, and the presets, each field's meaning
beside it. The machinery around the step (the data's files, checkpoints,
logging and evaluation, the launcher, the tools) and the extensions beyond
HLAT's recipe add their fields in nanohlat/recipe/configs.py, where reading
the flags and checking them and their combinations happen, before any of
this code runs.
"""

from __future__ import annotations

from dataclasses import dataclass


DEVICES = ("auto", "cpu", "cuda", "xla")   # --device of every command (device.py:get_device)


class UserError(Exception):
    """Bad input from the user. CLIs print it as one line and exit with code 2."""


@dataclass
class ModelConfig:
    """Shape of a LLaMA-2 / HLAT decoder (docs/design.md section 2)."""

    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4          # < n_heads means grouped-query attention
    ffn_dim: int = 688           # SwiGLU hidden size (LLaMA: ~8/3 * d_model)
    vocab_size: int = 4096       # tokenizer vocabulary (the model pads it, below)
    max_seq_len: int = 256       # longest sequence the rotary tables cover
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # The embedding and head are padded to a multiple of this, fixed by the
    # config and never by the tensor-parallel degree, so every layout has the
    # same padded vocabulary (docs/design.md 5.3). 128 divides by every tp we allow.
    vocab_multiple: int = 128

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """kv heads on one tensor-parallel rank. With more tp ranks than kv heads
        (HLAT-70B: 8 kv heads, tp 32) each rank holds a replica of one kv head."""
        return max(self.n_kv_heads // tp, 1)

    def layer_matrix_params(self, tp: int = 1) -> int:
        """Weights of one block's matrices on one tp rank (the whole block at tp 1):
        wq, wo (d x d) and gate, up, down (d x ffn) split over tp; wk, wv (d x kv)."""
        d, kv = self.d_model, self.kv_heads_per_rank(tp) * self.head_dim
        return (2 * d * d + 3 * d * self.ffn_dim) // tp + 2 * d * kv

    def num_params(self) -> int:
        """Parameters of the full (unsharded) model, padded vocabulary included:
        embedding and head, per layer its matrices and two RMSNorm gains, the final norm."""
        d, v, L = self.d_model, self.padded_vocab, self.n_layers
        return 2 * v * d + L * (self.layer_matrix_params() + 2 * d) + d


@dataclass
class TrainConfig:
    """The training run, but for the model's shape: its batch, AdamW, the layout and the precision."""

    # the batch: batch_size sequences of seq_len tokens per optimizer step (global,
    # over all data-parallel ranks), split on each dp rank into `microbatches`
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 256
    microbatches: int = 1
    # optimizer and schedule: HLAT-7B's betas, eps, weight decay and clipping (docs/design.md
    # section 2); lr and warm-up sized for the small CPU runs (the hlat-7b preset has HLAT's)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1337
    # devices and layout
    device: str = "auto"         # auto | cpu | cuda | xla
    tp: int = 1
    pp: int = 1
    dp: int = 0                  # 0 = world / (tp * pp)
    sequence_parallel: bool = False
    sp_regather: bool = True     # SP: keep the 1/tp input shard, all-gather it again in backward (Megatron)
    schedule: str = "1f1b"       # the pipeline schedule: afab | 1f1b (pipeline.py)
    zero: int = 0                # ZeRO stage: 0 none, 1 the optimizer state sharded over dp (zero1.py)
    bucket_mb: float = 25.0
    overlap_grad_reduce: bool = True   # start a bucket's dp collective in the backward (cpu, cuda)
    precision: str = "fp32"      # fp32 | bf16-mixed | bf16-sr | bf16
    moments: str = "fp32"        # fp32 | bf16 (Adam's moments, stochastically rounded; bf16-sr only)
    activation_checkpointing: str = "none"  # none | selective | full
    threads: int = 0             # CPU threads per worker (0 = cores / workers)
    rendezvous_timeout: float = 300.0      # seconds to wait for every rank to join the job
    collective_timeout: float = 300.0      # seconds a collective may wait for a peer before the job ends


# ---------------------------------------------------------------------------
# Presets. `tiny` is for tests (layers, heads and kv heads divisible by 4 so
# tp=4 and pp=4 work); `default` learns Python in a few CPU minutes; the HLAT
# rows are the paper's exact shapes and recipe.
# ---------------------------------------------------------------------------

PRESETS: dict[str, tuple[ModelConfig, dict]] = {
    "tiny": (
        ModelConfig(n_layers=4, d_model=64, n_heads=8, n_kv_heads=4, ffn_dim=176,
                    vocab_size=512, max_seq_len=64),
        dict(steps=20, batch_size=8, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_every=10),
    ),
    # what `python train.py` trains: sized to learn Python's look in ~5 minutes on 2 CPU cores
    "default": (
        ModelConfig(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, ffn_dim=688,
                    vocab_size=2048, max_seq_len=256),
        dict(steps=600, batch_size=8, seq_len=256, lr=3e-3, min_lr=3e-4, warmup_steps=60, eval_every=50,
             save_every=200),
    ),
    # twice the tokens per step and a larger vocabulary (the precision experiment's model)
    "small": (
        ModelConfig(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, ffn_dim=688,
                    vocab_size=4096, max_seq_len=256),
        dict(steps=300, batch_size=16, seq_len=256, lr=3e-3, min_lr=3e-4, warmup_steps=30, eval_every=50,
             save_every=100),
    ),
    "125m": (
        ModelConfig(n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, ffn_dim=2048,
                    vocab_size=32000, max_seq_len=2048),
        dict(batch_size=256, seq_len=2048, lr=6e-4, min_lr=6e-5, warmup_steps=2000, steps=60000),
    ),
    "1b": (
        ModelConfig(n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4, ffn_dim=5632,
                    vocab_size=32000, max_seq_len=2048),
        dict(batch_size=512, seq_len=2048, lr=4e-4, min_lr=4e-5, warmup_steps=2000, steps=100000),
    ),
    "hlat-7b": (
        ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                    vocab_size=32000, max_seq_len=4096),
        # 1024 x 4096 tokens (~4.2M) per step; 1.8T tokens ~ 430k steps
        dict(batch_size=1024, seq_len=4096, lr=3e-4, min_lr=3e-5, warmup_steps=2000, steps=430000,
             # HLAT's micro-batch of one sequence: 1024 / dp 256 = 4 per rank
             tp=8, microbatches=4, sequence_parallel=True, activation_checkpointing="selective",
             # and pure bf16 as HLAT's stack ran it: weights and Adam's moments in bf16, rounded randomly
             precision="bf16-sr", moments="bf16"),
    ),
    "hlat-70b": (
        ModelConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                    vocab_size=32000, max_seq_len=4096),
        dict(batch_size=1024, seq_len=4096, lr=1.5e-4, min_lr=1.5e-5, warmup_steps=2000, steps=430000,
             # micro-batches of one sequence at 2048 ranks (dp 8): 1024 / 8 = 128 per rank
             tp=32, pp=8, microbatches=128, zero=1, sequence_parallel=True,
             activation_checkpointing="selective", precision="bf16-mixed"),
    ),
}

