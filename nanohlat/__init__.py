"""nanohlat: a compact, commented reference implementation of HLAT-style LLaMA
pre-training with hand-written tensor, sequence, pipeline and data parallelism
and ZeRO-1. Start reading at train.py; README.md lists what each module is for."""
