"""Benchmark context-parallel attention per cp rank beside one process's (issue 47).

    python -m nanohlat.bench.cp_attention                 # tiny's attention shape, T = 2048, cp 2 and 4
    python -m nanohlat.bench.cp_attention --seq-len 4096 --cp 2,4,8 --rounds 9

What is timed is one layer's attention core, forward + backward, on each rank:
`context_parallel.attention` with each --cp-attention over gloo workers (one
thread each), and beside it, in the same workers, one process's causal attention
over the whole sequence (model.causal_attention, what a cp-1 run calls), run by
rank 0 while the others wait. Rounds alternate the four, in a rotating order, so
that load from anything else on the machine hits them alike; a figure is the
median over rounds, and a ratio the median of each round's ratio (the slowest
cp rank's over one process's in the same round) with its range.

Two clocks: the rank's CPU time, and wall time. CPU time is the whole worker
process's (time.process_time: every thread of it), not its main thread's alone:
torch runs one thread here for the arithmetic, but gloo moves the bytes and
adds them up (allgather's backward reduce-scatters K/V's gradients) on threads
of its own, and that work is the algorithm's too. It leaves out the time a
rank waited for a peer (blocked, not running). On a machine with fewer free cores than cp ranks the
ranks take turns and wall time says more about the machine than about the
algorithm; the CPU time does not. A rank's figure is the slowest cp rank's (the
others wait for it in the next layer), and the ratio is to one process's: the
ideal is 1/cp (each rank computes 1/cp of the causal pairs).

This is a benchmark, not a test: it asserts nothing about speed. It refuses, in
one line (exit 2), what it cannot measure: a size or a round count below 1, a
--seq-len that 2 x cp chunks do not split. A worker that fails ends the run at
once with that worker's one-line error (exit 1), and Ctrl-C with "interrupted"
(exit 130), the workers stopped with it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from queue import Empty

import torch

from nanohlat.beyond.context_parallel import kernel
from nanohlat.config import PRESETS, UserError
from nanohlat.system import cli, flags

ALGORITHMS = ("allgather", "ring", "ulysses")
ONE = "one process"
POLL_S = 0.2   # how often the parent looks for a worker that died without a word


def _worker(rank, world, port, args, queue):
    """One cp rank: its timings, or its error as one line (launch.crash_line), on `queue`."""
    from nanohlat.run.launch import crash_line
    try:
        queue.put((rank, _timings(rank, world, port, args), None))
    except KeyboardInterrupt:   # Ctrl-C reaches the workers too: the parent says "interrupted"
        os._exit(130)
    except BaseException as e:  # (the parent ends the run with this line: no other rank waits for it)
        queue.put((rank, None, crash_line(e)))
        queue.close()
        queue.join_thread()     # (the line is sent before the process ends: put only hands it to a thread)
        os._exit(1)


def _timings(rank, world, port, args) -> dict:
    import datetime

    import torch.distributed as dist

    from nanohlat.beyond import context_parallel as cpl
    from nanohlat.comm import Group, all_reduce
    from nanohlat.model import causal_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    group = Group("cp", list(range(world)), rank, dist.new_group(list(range(world))))

    def barrier():   # every rank here before the next timing: a one-number all-reduce (comm.py's)
        all_reduce(torch.zeros(1), group)
    B, H, K, T, D, dtype = args["batch"], args["heads"], args["kv_heads"], args["seq_len"], args["head_dim"], args["dtype"]
    g = torch.Generator().manual_seed(0)    # the same tensors on every rank
    full = [torch.randn(B, h, T, D, generator=g).to(dtype) for h in (H, K, K)]
    upstream = torch.randn(B, H, T, D, generator=g).to(dtype)
    table = cpl.zigzag_positions(T, world)
    mine = table[rank]

    ours = [x[:, :, mine].clone().requires_grad_() for x in full], upstream[:, :, mine].clone()
    whole = [x.clone().requires_grad_() for x in full], upstream

    def cp_step(algorithm):
        (q, k, v), grad = ours
        cpl.attention(q, k, v, group, table, algorithm).backward(grad)

    def one_step():
        (q, k, v), grad = whole
        causal_attention(q, k, v).backward(grad)

    names = [a for a in ALGORITHMS if a != "ulysses" or (H % world == 0 and K % world == 0)]
    steps = {**{a: (lambda a=a: cp_step(a)) for a in names}, ONE: one_step}
    times = {n: [] for n in steps}
    for r in range(args["rounds"] + 1):                  # round 0 warms up, untimed
        order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
        for name in order:
            barrier()
            if name == ONE and rank != 0:
                continue
            cpu, wall = time.process_time(), time.perf_counter()     # (every thread's CPU time: gloo's too)
            steps[name]()
            if r:
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    barrier()
    dist.destroy_process_group()
    return times


def run(world: int, args: dict) -> dict:
    """{name: [each rank's [(cpu, wall) of each round]]} for cp `world` (the one process: rank 0's only)."""
    import torch.multiprocessing as mp

    from nanohlat.run.launch import free_port, start_method
    ctx = mp.get_context(start_method())
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:   # each rank's timings; the first error (or a rank gone silent) ends the run
            try:
                rank, times, error = queue.get(timeout=POLL_S)
            except Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead and queue.empty():
                    raise RuntimeError(f"rank {dead[0]} of the cp {world} workers exited with code "
                                       f"{procs[dead[0]].exitcode} and said nothing") from None
                continue
            if error is not None:
                raise RuntimeError(f"rank {rank} of the cp {world} workers failed: {error}")
            got[rank] = times
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:   # (a failure or Ctrl-C: the other ranks would wait for it in a collective)
            if p.is_alive():
                p.kill()
                p.join()
    out = {}
    for rank in range(world):
        for name, ts in got[rank].items():
            if ts:
                out.setdefault(name, []).append(ts)
    return out


def slowest(ranks: list) -> list[tuple[float, float]]:
    """Round by round, the slowest rank's (cpu, wall): the others wait for it in the next layer."""
    return [tuple(max(r[i][j] for r in ranks) for j in (0, 1)) for i in range(len(ranks[0]))]


def figures(rounds: list, one: list) -> tuple:
    """(median cpu, median wall, [cpu ratio to one process per round], [wall ratio per round]): each
    round's ratio against one process's of the same round."""
    return (statistics.median(c for c, _ in rounds), statistics.median(w for _, w in rounds),
            [c / o for (c, _), (o, _) in zip(rounds, one)], [w / o for (_, w), (_, o) in zip(rounds, one)])


def ratio_text(r: list) -> str:
    """A ratio's median over the rounds and its range: '0.54 (0.52-0.57)'."""
    return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"


def check(a) -> list[int]:
    """The cp sizes of --cp, once every size is one the bench can measure (UserError, one line, otherwise)."""
    for name in ("seq_len", "batch_size", "rounds"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}: there would "
                            f"be nothing to time")
    sizes = [int(c) for c in a.cp.split(",") if c.strip().isdigit()]
    if not sizes or len(sizes) != len(a.cp.split(",")) or min(sizes) < 2:
        raise UserError(f"--cp {a.cp!r}: give comma-separated cp sizes of 2 or more, e.g. --cp 2,4")
    for n in sizes:
        if a.seq_len % (2 * n):
            raise UserError(f"--seq-len {a.seq_len} does not split into 2 x cp = {2 * n} chunks: make it a "
                            f"multiple of {2 * n}")
    return sizes


@cli.command
def main(argv=None) -> int:
    p = flags.Parser(prog="python -m nanohlat.bench.cp_attention", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="the attention shape's model (tiny)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the micro-batch (2)")
    p.add_argument("--cp", default="2,4", help="comma-separated cp sizes (2,4)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up (5)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    a = p.parse_args(argv)
    cfg = PRESETS[a.preset][0]
    args = dict(batch=a.batch_size, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                seq_len=a.seq_len, rounds=a.rounds, dtype=torch.float32 if a.precision == "fp32" else torch.bfloat16)
    sizes = check(a)
    print(f"attention of {a.preset}: {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads of dim {cfg.head_dim}; "
          f"{a.batch_size} x {a.seq_len} tokens, {a.precision}; forward + backward of one layer, median of "
          f"{a.rounds} rounds, one thread a rank; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"each rank's pairs: {kernel('cpu')}; one process: model.causal_attention")
    print(f"  {'cp':>2}  {'algorithm':<11} {'cpu ms':>8} {'x one':>17} {'wall ms':>8} {'x one':>17}   "
          f"(the slowest cp rank; cpu: all its threads, gloo's too; 'x one': over one process's in the same "
          f"round, the median over rounds and their range; ideal 1/cp)")
    for n in sizes:
        try:
            res = run(n, args)
        except RuntimeError as e:   # a worker's error (run): its one line, exit 1 (a failure, not bad input)
            print(f"error: {e}", file=sys.stderr)
            return 1
        one = res[ONE][0]
        one_cpu, one_wall = statistics.median(c for c, _ in one), statistics.median(w for _, w in one)
        print(f"  {1:>2}  {ONE:<11} {1e3 * one_cpu:8.1f} {'1':>17} {1e3 * one_wall:8.1f} {'1':>17}")
        for name in (x for x in ALGORITHMS if x in res):
            cpu, wall, rc, rw = figures(slowest(res[name]), one)
            print(f"  {n:>2}  {name:<11} {1e3 * cpu:8.1f} {ratio_text(rc):>17} {1e3 * wall:8.1f} {ratio_text(rw):>17}")
    print(f"  (load {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
