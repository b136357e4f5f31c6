"""Beyond HLAT's recipe: the layouts and layers that HLAT did not train with, each
applied from outside the core (train.py and nanohlat/*.py know none of them).

One module a tutorial section; run/build.py switches each on with one call, in
the order a rank is put together:

zero2.py, zero3.py: ZeRO-2 (the gradients sharded too) and ZeRO-3 (the
parameters too), DP strategies handed to optim.FlatAdamW (chapter 3).
schedules.py, split_backward.py: the interleaved and ZB-H1 pipeline schedules,
runners of their own, and ZB-H1's split linears (chapter 5).
moe.py: a mixture of experts in place of some MLPs, and expert parallelism (chapter 10).
context_parallel.py: one sequence over several ranks, attention across them (chapter 11).
fp8_scaling.py, fp8.py, fp8_experts.py, fp8_stats.py: each linear's matmuls in eight bits, five
scaling recipes, in every layout as in one process (chapter 7).
"""
