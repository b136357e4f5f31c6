"""Measuring and planning: tools a student runs beside training, not inside it.

The memory/communication/time plan behind `train.py --plan` (plan.py), FLOPs
per token, peak FLOP/s and MFU (metrics.py), the
pipeline timeline and its bubble (timeline.py), torch.compile of
the stage (compile.py, `--compile`), the optimizer's faster passes (fast_adamw.py:
cache-blocked on the CPU, compiled with --compile) and tutorial chapter 2's
graph-compiler lessons (compile_lessons.py). The core modules never import these.
"""
