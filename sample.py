"""Generate text from a trained nanohlat checkpoint, streaming token by token.

    python sample.py                                  # out/'s latest checkpoint, a Python-ish prompt
    python sample.py --out-dir runs/x --prompt "def fib(n):" --max-new-tokens 200
    python sample.py --checkpoint runs/x/checkpoints/step_00000300 --prompt-file prompts.txt --batch-size 4
    python sample.py --nproc 2 --tp 2 --top-k 1       # tensor-parallel: 2 ranks, each half of every layer
    torchrun --nproc_per_node 2 sample.py --tp 2

Any checkpoint loads here, whatever (tp, pp, dp, zero1) layout trained it:
each rank rebuilds the full tensors from the shards and keeps its tp slice
(generate.load_model; a mixture of experts' experts are not split: each
rank holds them all). Generation reuses a KV cache: the prompts run through
the model once (prefill), then each new token costs one single-position
forward pass (decode). `--prompt-file` holds one prompt per line (a literal
\\n in a line is a newline); `--batch-size` prompts are decoded together, each
row with its own positions, giving the tokens each would get alone (but a
mixture of experts in capacity mode, whose drops depend on the batch).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch
import torch.distributed

from nanohlat.run import checkpoint, data, launch
from nanohlat.serving import generate
from nanohlat.system import cli, flags
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.config import DEVICES, UserError
from nanohlat.recipe import check_seed, model_from_dict


def parse_args(argv=None):
    p = flags.Parser(description="Sample from a nanohlat checkpoint.")
    p.add_argument("--out-dir", default="out", help="run directory (its latest checkpoint is used)")
    p.add_argument("--checkpoint", default="", help="a checkpoint directory (overrides --out-dir)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--prompt-file", default="", help="one prompt per line (overrides --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--batch-size", type=int, default=1, help="prompts (or samples) decoded together")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--nproc", type=int, default=1, help="local worker processes to start (one per tp rank)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: --nproc, or torchrun's world size")
    return p.parse_args(argv)


def read_prompts(args) -> list[str]:
    if not args.prompt_file:
        return [args.prompt]
    if os.path.exists(args.prompt_file) and not os.path.isfile(args.prompt_file):   # a FIFO or /dev/zero would
        raise UserError(f"--prompt-file {args.prompt_file!r} is not a regular file; give a text file")  # never end
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    except OSError as e:
        raise UserError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text; give a text file") from None
    if not prompts:
        raise UserError(f"--prompt-file {args.prompt_file!r} has no prompts (one per line)")
    return prompts


def check_args(args, world: int) -> None:
    """Refuse bad flags once, before any worker starts."""
    for name, low in (("max_new_tokens", 1), ("num_samples", 1), ("batch_size", 1), ("nproc", 1), ("tp", 1),
                      ("top_k", 0), ("seed", 0)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    check_seed(args.seed)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.tp != world:
        raise UserError(f"--tp {args.tp} but {world} process(es): sampling splits the model over every "
                        f"process, so use --nproc {args.tp} (or torchrun --nproc_per_node {args.tp})")
    manifest = checkpoint.read_manifest(checkpoint.resolve(args.checkpoint or args.out_dir, say_skipped=True))
    generate.check_tp(model_from_dict(manifest["config"]["model"]), args.tp)


def sample(args, dev, mesh=None) -> None:
    """Load this rank's slice of the model and generate; rank 0 prints."""
    model, manifest = generate.load_model(args.checkpoint or args.out_dir, dev, mesh)
    write = sys.stdout.write if mesh is None or mesh.rank == 0 else (lambda s: None)
    tok = data.load_tokenizer(manifest["tokenizer"])
    limit = model.cfg.max_seq_len
    jobs = [(i, s, text) for i, text in enumerate(read_prompts(args)) for s in range(args.num_samples)]
    gen = torch.Generator().manual_seed(args.seed)
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start:start + args.batch_size]
        ids = []
        note = (lambda line: print(line, file=sys.stderr)) if mesh is None or mesh.rank == 0 else None
        for _, _, text in batch:     # a prompt too long for the context keeps its end, with a note
            ids.append(generate.fit_prompt([tok.bos_id] + tok.encode(text), limit, args.max_new_tokens, note))
        outs: list[list[int]] = [[] for _ in batch]
        stream, shown = len(jobs) == 1, ""
        if stream:
            write(batch[0][2])
            sys.stdout.flush()
        for step in generate.generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, gen,
                                      eos_id=tok.eos_id, sync=dev.sync):
            for out, t in zip(outs, step):
                if t is not None and t != tok.eos_id:
                    out.append(t)
            if stream and step[0] not in (None, tok.eos_id):
                text = tok.decode(outs[0])    # decode the whole tail, print what is new: pieces can merge bytes
                write(text[len(shown):])
                sys.stdout.flush()
                shown = text
        for (i, s, text), out in zip(batch, outs):
            if not stream:
                header = ([f"prompt {i + 1}"] if len(jobs) > args.num_samples else []) + \
                         ([f"sample {s + 1}"] if args.num_samples > 1 else [])
                write(f"--- {', '.join(header)} ---\n{text}{tok.decode(out)}")
            write("\n")
    sys.stdout.flush()


@contextlib.contextmanager
def stdout_to_stderr():
    """While process groups form, send file descriptor 1 to stderr: some torch
    versions' gloo (2.9) print a "[Gloo] Rank r is connected to ..." line on
    stdout, which would end up in the middle of the generated text."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def worker(argv: list[str]) -> None:
    """One tensor-parallel rank (sample.py --nproc N, or torchrun)."""
    rank, world, local_rank = launch.torchrun_env()
    args = parse_args(argv)
    try:
        dev = devicelib.get_device(args.device, local_rank)
        if dev.kind == "cpu":
            devicelib.set_cpu_threads(max(1, (os.cpu_count() or 1) // launch.local_world_size()))
        manifest = checkpoint.read_manifest(checkpoint.resolve(args.checkpoint or args.out_dir))
        kv = meshlib.kv_replicas(model_from_dict(manifest["config"]["model"]), args.tp)   # tp > kv heads: copies
        with stdout_to_stderr():   # stdout carries the generated text only
            dev.init_process_group(rank, world)
            mesh = meshlib.Mesh(args.tp, 1, 1, rank, kv_replicas=kv).build_groups(dev)
        sample(args, dev, mesh)
    except UserError as e:
        launch.report_error(str(e))   # to the launcher, which says it once for all ranks
        sys.exit(2)
    except Exception as e:
        launch.worker_stub(e)   # an exercise stub of a student copy: its one line, exit 2
        raise
    torch.distributed.destroy_process_group()


@cli.command
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    read_prompts(args)
    env = launch.torchrun_env()
    launch.check_nproc(args.nproc, env)
    check_args(args, env[1] if env else args.nproc)
    if env:
        worker(argv)
    elif args.nproc > 1:
        return launch.spawn(worker, (argv,), args.nproc, stop_hint="")   # (nothing to resume)
    else:
        sample(args, devicelib.get_device(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
