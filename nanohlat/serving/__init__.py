"""Using a trained model: generation, serving, evaluation, Hugging Face interop.

Generation with a KV cache, on one process or tensor-parallel (generate.py),
batched serving and speculative decoding (server.py, `python -m
nanohlat.serving`), held-out loss and multiple-choice scoring (evaluate.py,
used by eval.py), export/import to Hugging Face's Llama (hf.py, `python -m
nanohlat.hf`) and the lm-evaluation-harness adapter (harness.py, `python -m
nanohlat.harness`). They stand on run/ (the checkpoints and the tokenizer a
run saved, docs/design.md 1); the core modules never import these.
"""
