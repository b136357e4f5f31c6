"""Generate text from a trained nanohlat checkpoint, streaming token by token.

    python sample.py                                  # out/'s latest checkpoint, a Python-ish prompt
    python sample.py --out-dir runs/x --prompt "def fib(n):" --max-new-tokens 200
    python sample.py --checkpoint runs/x/checkpoints/step_00000300 --prompt-file p.py

Any checkpoint loads here, whatever (tp, pp, dp, zero1) layout trained it:
the shards are stitched back into one model (checkpoint.load_for_inference).
Generation reuses a KV cache: the prompt runs through the model once, then
each new token costs one single-position forward pass.
"""

from __future__ import annotations

import argparse
import sys

import torch

from nanohlat import checkpoint, data
from nanohlat import device as devicelib
from nanohlat.config import DEVICES, UserError


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Sample from a nanohlat checkpoint.")
    p.add_argument("--out-dir", default="out", help="run directory (its latest checkpoint is used)")
    p.add_argument("--checkpoint", default="", help="a checkpoint directory (overrides --out-dir)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--prompt-file", default="", help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=DEVICES)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.max_new_tokens <= 0:
            raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
        prompt = args.prompt
        if args.prompt_file:
            try:
                with open(args.prompt_file, encoding="utf-8") as f:
                    prompt = f.read()
            except OSError as e:
                raise UserError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from None
        dev = devicelib.get_device(args.device)
        model, manifest = checkpoint.load_for_inference(args.checkpoint or args.out_dir, dev)
        tok = data.load_tokenizer(manifest["tokenizer"])
        ids = [tok.bos_id] + tok.encode(prompt)
        limit = model.cfg.max_seq_len
        if len(ids) >= limit:
            ids = [tok.bos_id] + ids[-(limit // 2):]        # keep the end of a long prompt
        torch.manual_seed(args.seed)
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        for i in range(args.num_samples):
            if args.num_samples > 1:
                print(f"--- sample {i + 1} ---")
            sys.stdout.write(prompt)
            sys.stdout.flush()
            tokens = torch.tensor([ids], device=dev.torch_device)
            out: list[int] = []
            shown = ""
            for nxt in model.generate(tokens, args.max_new_tokens, args.temperature, args.top_k,
                                      generator=gen if dev.kind == "cpu" else None):
                dev.sync()   # XLA: run this token's graph and keep the KV cache, or every token recomputes all before it
                t = int(nxt[0, 0])
                if t == tok.eos_id:
                    break
                out.append(t)
                text = tok.decode(out)        # decode the whole tail: pieces can merge bytes
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
            sys.stdout.write("\n")
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
