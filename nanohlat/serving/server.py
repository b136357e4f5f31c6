"""Serving, part 2: scheduling requests, and speculative decoding.

    python -m nanohlat.serving --target runs/big --draft runs/small --k 4    # speculative decoding, measured

Requests arrive at random times, each a prompt and a number of tokens to
produce. Decode steps are memory-bound (generate.py), so a step for 8 rows
costs little more than a step for 1: a server wants full batches. Two ways to
keep them full, run here on the real model and the same requests:

  static batching      when the model is free, take up to B waiting requests,
                       prefill them together and decode until the longest one
                       has finished; the batch's answers leave together. Rows
                       that finished early idle in the batch, and requests that
                       arrive meanwhile wait for the whole batch.
  continuous batching  (Yu et al. 2022, "Orca", OSDI; the scheduler of vLLM,
                       Kwon et al. 2023) the batch is B slots, each with its
                       own cache rows. Before every decode step, the free
                       slots take the waiting requests (their prompts are
                       prefilled together into those slots' rows), and a
                       request that finishes leaves at once, freeing its slot.

generate.py's per-row positions make the second possible: a row's tokens need
not be aligned with anyone else's. (vLLM also pages the cache, so that a slot
does not reserve max_seq_len columns; here every slot reserves its longest.)

Time is a simulated clock: every model call advances it by the wall time it
took, and when no request is waiting it jumps to the next arrival (no
sleeping). Latency = finish - arrival; throughput = tokens produced / (last
finish - first arrival). `python -m nanohlat.bench --generate` prints both
schedulers on one stream.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023): a small draft model
proposes k tokens one by one; the target model checks all k in ONE forward
pass (k + 1 positions: as cheap as a decode step, being memory-bound), keeps
the longest acceptable prefix and adds one token of its own. Accepting draft
token d with probability min(1, p(d) / q(d)) (p target, q draft) and, on a
rejection, drawing from max(p - q, 0) renormalised gives tokens distributed
exactly as the target alone would sample them; greedily, a token is accepted
when it is the target's argmax, so the output is the target's greedy output.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from nanohlat.system import flags
from nanohlat.serving import generate as gen
from nanohlat.config import DEVICES, UserError
from nanohlat.recipe import check_seed
from nanohlat.system import cli


# ---------------------------------------------------------------------------
# Requests and the simulated clock
# ---------------------------------------------------------------------------

@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float                       # seconds on the simulated clock
    output: list[int] = field(default_factory=list)
    finish: float | None = None


def arrival_stream(n: int, rate: float, vocab_size: int, seed: int = 0, prompt_len=(8, 64),
                   new_tokens=(8, 64)) -> list[Request]:
    """n requests arriving as a Poisson process of `rate` per second, with
    random prompts (token ids) and output lengths, uniform in the given ranges."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        out.append(Request(i, prompt, rng.randint(*new_tokens), t))
    return out


class Clock:
    """Simulated time: advanced by the measured duration of each model call."""

    def __init__(self):
        self.now = 0.0

    def run(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)                  # callers return host values: the device has finished
        self.now += time.perf_counter() - start
        return out

    def wait_for(self, t: float) -> None:
        self.now = max(self.now, t)


def summary(requests: list[Request]) -> dict:
    tokens = sum(len(r.output) for r in requests)
    span = max(r.finish for r in requests) - min(r.arrival for r in requests)
    return {"requests": len(requests), "tokens": tokens, "seconds": span, "tokens_per_s": tokens / span,
            "mean_latency_s": sum(r.finish - r.arrival for r in requests) / len(requests)}


# ---------------------------------------------------------------------------
# The two schedulers (greedy decoding; same tokens as each request alone)
# ---------------------------------------------------------------------------

def serve_static(model, requests: list[Request], batch_size: int) -> dict:
    """Request-level batching. Fills each request's output and finish time."""
    clock, queue = Clock(), deque(sorted(requests, key=lambda r: r.arrival))
    while queue:
        clock.wait_for(queue[0].arrival)                      # idle until someone is there
        batch = []
        while queue and len(batch) < batch_size and queue[0].arrival <= clock.now:
            batch.append(queue.popleft())
        steps = gen.generate(model, [r.prompt for r in batch], [r.max_new_tokens for r in batch])
        while True:
            new = clock.run(next, steps, None)                # prefill, then one decode step per call
            if new is None:
                break
            for r, t in zip(batch, new):
                if t is not None:
                    r.output.append(t)
        for r in batch:
            r.finish = clock.now                              # the batch's answers leave together
    return summary(requests)


def _step(model, cache, tokens: list[int], positions: list[int]) -> list[int]:
    device = model.cos.device
    logits = gen.decode_step(model, cache, torch.tensor(tokens, device=device), torch.tensor(positions, device=device))
    return gen.pick(logits).tolist()


def _admit(model, cache, slots: list[int], reqs: list[Request]) -> list[int]:
    """Prefill the newcomers together (one pass) into a scratch cache, copy each
    one's keys and values into its slot's row; returns their first new tokens.
    (vLLM's paged cache lets the prefill write into the slots' pages directly.)"""
    scratch = gen.new_cache(model, len(reqs), max(len(r.prompt) for r in reqs))
    first = gen.pick(gen.prefill(model, scratch, [r.prompt for r in reqs])).tolist()
    for i, (s, r) in enumerate(zip(slots, reqs)):
        n = len(r.prompt)
        for layer, (k, v) in cache.items():
            k[s, :, :n], v[s, :, :n] = scratch[layer][0][i, :, :n], scratch[layer][1][i, :, :n]
    return first


def serve_continuous(model, requests: list[Request], slots: int, clock: Clock | None = None) -> dict:
    """Iteration-level batching over `slots` rows. Fills outputs and finish times. `clock`: what
    times the model's calls (default a Clock; the figures' counts passes instead)."""
    clock, queue = clock or Clock(), deque(sorted(requests, key=lambda r: r.arrival))
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    if longest > model.cfg.max_seq_len:
        raise UserError(f"a request needs {longest} positions, the model has {model.cfg.max_seq_len}")
    cache = gen.new_cache(model, slots, longest)
    active: list[Request | None] = [None] * slots
    tokens, positions = [0] * slots, [0] * slots             # each slot's newest token and its position

    def emit(s: int, t: int) -> None:
        r = active[s]
        r.output.append(t)
        tokens[s], positions[s] = t, len(r.prompt) + len(r.output) - 1
        if len(r.output) >= r.max_new_tokens:
            r.finish, active[s] = clock.now, None             # leaves now; the slot is free

    while queue or any(active):
        if not any(active):
            clock.wait_for(queue[0].arrival)
        free = [s for s in range(slots) if active[s] is None]
        newcomers = []                                        # admit arrived requests into free slots
        while len(newcomers) < len(free) and queue and queue[0].arrival <= clock.now:
            newcomers.append(queue.popleft())
        if newcomers:
            taken = free[:len(newcomers)]
            for s, r in zip(taken, newcomers):
                active[s] = r
            for s, t in zip(taken, clock.run(_admit, model, cache, taken, newcomers)):
                emit(s, t)
        if any(active):                                       # one decode step, every slot
            new = clock.run(_step, model, cache, tokens, positions)
            for s in range(slots):
                if active[s] is not None:
                    emit(s, new[s])
    return summary(requests)


# ---------------------------------------------------------------------------
# Speculative decoding (one sequence)
# ---------------------------------------------------------------------------

def accept_or_resample(p: torch.Tensor, q: torch.Tensor, token: int, generator=None) -> tuple[int, bool]:
    """The draft proposed `token` ~ q; return (token, True) with probability
    min(1, p[token] / q[token]), else (a draw from max(p - q, 0), False). Over
    the draft's draw and this one, the result is distributed exactly as p:
    P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x) = p(x)."""
    u = torch.rand((), generator=generator)
    if u * q[token] < p[token]:
        return token, True
    residual = (p - q).clamp(min=0)
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False


class _Cached:
    """One model, one sequence: its cache and how many tokens it already holds."""

    def __init__(self, model, length: int):
        self.model, self.cache, self.held = model, gen.new_cache(model, 1, length), 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Write tokens at positions held.. and return their next-token logits (T, vocab)."""
        device = self.model.cos.device
        positions = torch.arange(self.held, self.held + len(tokens), device=device).view(1, -1)
        logits = gen.cached_forward(self.model, self.cache, torch.tensor([tokens], device=device), positions)
        self.held += len(tokens)
        return gen.full_logits(logits[0], self.model)


@torch.no_grad()
def check_contexts(target, draft, prompt_len: int, max_new_tokens: int) -> int:
    """The sequence length speculative decoding reaches (the target's answer's),
    or UserError when the draft's context is too short for it. Refused rather
    than cut short: the answer must be the target's, and the draft cannot
    propose past its own context."""
    total = min(prompt_len + max_new_tokens, target.cfg.max_seq_len)
    if total > draft.cfg.max_seq_len:
        raise UserError(f"the draft's context is {draft.cfg.max_seq_len} tokens, shorter than the {total} this "
                        f"prompt and --max-new-tokens need (the target's is {target.cfg.max_seq_len}); lower "
                        f"--max-new-tokens to {max(0, draft.cfg.max_seq_len - prompt_len)} or use a draft "
                        f"trained with --max-seq-len {target.cfg.max_seq_len}")
    return total


@torch.no_grad()
def speculative_generate(target, draft, prompt: list[int], max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, top_k: int = 0, generator=None) -> tuple[list[int], dict]:
    """New tokens for `prompt` from `target`, with `draft` proposing k at a time.
    Returns (tokens, stats: proposed, checked, accepted, target_passes,
    draft_passes). A round's drafts are checked in order up to the first
    rejection: `checked` counts those compared, so accepted / checked is the
    per-token acceptance a, and accepted / proposed the share of drafts kept."""
    total = check_contexts(target, draft, len(prompt), max_new_tokens)
    tgt, drf = _Cached(target, total), _Cached(draft, total)
    tokens = list(prompt)
    stats = {"proposed": 0, "checked": 0, "accepted": 0, "target_passes": 0, "draft_passes": 0}
    dist = lambda logits: gen.probabilities(logits, temperature, top_k)
    if len(prompt) > 1:                      # both caches hold all tokens but the newest
        tgt.feed(prompt[:-1]), drf.feed(prompt[:-1])
    while len(tokens) < total:
        n = min(k, total - len(tokens) - 1)               # drafts this round (+1 token of the target's)
        drafts, qs = [], []
        for i in range(n):
            if i == 0:
                logits = drf.feed(tokens[drf.held:])[-1]  # the 1 or 2 tokens the draft has not seen
            qs.append(dist(logits).cpu() if temperature > 0 else None)
            drafts.append(int(gen.pick(logits[None], temperature, top_k, generator)[0]))
            stats["draft_passes"] += 1
            if i < n - 1:
                logits = drf.feed(drafts[-1:])[-1]
        held_before = len(tokens)
        p_logits = tgt.feed(tokens[tgt.held:] + drafts)[-(n + 1):]   # ONE pass checks all n
        stats["target_passes"] += 1
        new = []
        for i, d in enumerate(drafts):
            if temperature <= 0:
                ok, t = d == int(p_logits[i].argmax()), int(p_logits[i].argmax())
            else:
                t, ok = accept_or_resample(dist(p_logits[i]).cpu(), qs[i], d, generator)
            new.append(t)
            stats["checked"] += 1
            if not ok:
                break
        else:                                              # all accepted: the target's own next token
            new.append(int(gen.pick(p_logits[n][None], temperature, top_k, generator)[0]))
        accepted = len(new) - 1
        stats["proposed"] += n
        stats["accepted"] += accepted
        tokens += new
        # caches keep only what is now part of the sequence (stale columns get overwritten)
        tgt.held = held_before + accepted
        drf.held = min(drf.held, held_before + accepted)
    return tokens[len(prompt):], stats


# ---------------------------------------------------------------------------
# python -m nanohlat.serving: speculative decoding, measured
# ---------------------------------------------------------------------------

def _same_tokenizer(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


@cli.command
def main(argv=None) -> int:
    from nanohlat.run import data
    from nanohlat import device as devicelib
    p = flags.Parser(description="Speculative decoding: a draft model proposes, the target checks.")
    p.add_argument("--target", required=True, help="run directory or checkpoint of the model to sample from")
    p.add_argument("--draft", required=True, help="a smaller model trained with the same tokenizer")
    p.add_argument("--k", type=int, default=4, help="tokens the draft proposes per target pass")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = PyTorch's default)")
    args = p.parse_args(argv)
    if args.k <= 0 or args.max_new_tokens <= 0:
        raise UserError("--k and --max-new-tokens must be positive")
    check_seed(args.seed)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.threads < 0:
        raise UserError(f"--threads must be at least 1 (0 = PyTorch's default), got {args.threads}")
    dev = devicelib.get_device(args.device)
    if args.threads and dev.kind == "cpu":
        devicelib.set_cpu_threads(args.threads)
    target, tm = gen.load_model(args.target, dev)
    draft, dm = gen.load_model(args.draft, dev)
    if target.cfg.vocab_size != draft.cfg.vocab_size or not _same_tokenizer(tm["tokenizer"], dm["tokenizer"]):
        raise UserError(f"the draft ({args.draft}) and the target ({args.target}) must share one tokenizer; "
                        f"train the draft with the target's --tokenizer (or the same corpus and --vocab-size)")
    return compare(args, target, draft, data.load_tokenizer(tm["tokenizer"]))


def tokens_per_pass_formula(a: float, k: int) -> float:
    """Expected tokens per target pass, (1 - a^(k+1)) / (1 - a), when each of k
    drafts is accepted independently with probability a (k + 1 at a = 1)."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def tokens_per_pass_bound(a: float, k: int) -> float:
    """The most tokens per target pass a run with per-token acceptance a can
    have measured, whatever the pattern of its rejections: a pass yields its
    accepted drafts + 1 and ends at its first rejection, so target passes >=
    rejections = checked - accepted, and accepted / passes <= a / (1 - a).
    Hence tokens / passes <= min(k + 1, 1 / (1 - a)) (k + 1 at a = 1)."""
    return float(k + 1) if a >= 1 else min(float(k + 1), 1 / (1 - a))


def _best_of(n: int, fn):
    """(fn's result, its shortest wall time over n calls): the least disturbed by other load."""
    best = math.inf
    for _ in range(n):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def report(k: int, n_tokens: int, st: dict, t_alone: float, t_draft: float, t_spec: float) -> list[str]:
    """compare's figures: acceptance, tokens per target pass beside the formula,
    the measured speed-up beside what the passes and the draft's cost predict."""
    a = st["accepted"] / max(1, st["checked"])
    per_pass = n_tokens / st["target_passes"]
    c = t_draft / t_alone                  # a draft decode step's cost, in target decode steps
    predicted = n_tokens / (st["target_passes"] + c * st["draft_passes"])
    needed = (n_tokens - st["target_passes"]) / max(1, st["draft_passes"])
    return [
        f"drafts kept: {st['accepted']} of {st['proposed']} proposed ({st['accepted'] / max(1, st['proposed']):.2f}); "
        f"checked up to a round's first rejection: {st['checked']}",
        f"per-token acceptance a = accepted / checked = {st['accepted']} / {st['checked']} = {a:.2f}",
        f"tokens per target pass: measured {per_pass:.2f}, formula (1 - a^(k+1)) / (1 - a) = "
        f"{tokens_per_pass_formula(a, k):.2f} with k = {k} (the formula assumes each draft is accepted "
        f"independently, with probability a)",
        f"whatever the pattern of rejections: 1 <= measured <= min(k + 1, 1 / (1 - a)) = "
        f"{tokens_per_pass_bound(a, k):.2f} (a pass ends at its first rejection)",
        f"a draft decode step costs c = {c:.2f} of a target decode step (each timed alone)",
        f"speed-up: measured {t_alone / t_spec:.2f}x; from the passes {predicted:.2f}x = {n_tokens} tokens / "
        f"({st['target_passes']} target + {c:.2f} x {st['draft_passes']} draft passes), a pass over k + 1 tokens "
        f"counted as one decode step",
        f"speculative decoding pays here when c < {needed:.2f} = ({n_tokens} - {st['target_passes']}) / "
        f"{st['draft_passes']}, the target passes saved per draft pass",
    ]


def compare(args, target, draft, tok) -> int:
    """main's measurement: the target alone, the draft alone (its cost), then
    speculative decoding, same seed; each timed as the best of 5 runs."""
    note = lambda line: print(line, file=sys.stderr)
    ids = gen.fit_prompt([tok.bos_id] + tok.encode(args.prompt), target.cfg.max_seq_len, args.max_new_tokens,
                         note)     # sample.py's policy: a long prompt keeps its end, said in a note
    check_contexts(target, draft, len(ids), args.max_new_tokens)     # before any pass
    seeded = lambda: torch.Generator().manual_seed(args.seed)
    gen.generate_lists(target, [ids], 2), gen.generate_lists(draft, [ids], 2)    # warm up both, untimed
    alone, t_alone = _best_of(5, lambda: gen.generate_lists(target, [ids], args.max_new_tokens,
                                                            temperature=args.temperature, generator=seeded())[0])
    _, t_draft = _best_of(5, lambda: gen.generate_lists(draft, [ids], len(alone), temperature=args.temperature,
                                                        generator=seeded()))
    (spec, st), t_spec = _best_of(5, lambda: speculative_generate(target, draft, ids, args.max_new_tokens, args.k,
                                                                  args.temperature, generator=seeded()))
    print(f"target {target.cfg.num_params() / 1e6:.2f}M parameters, draft {draft.cfg.num_params() / 1e6:.2f}M; "
          f"{'greedy' if args.temperature <= 0 else f'temperature {args.temperature}'}, k = {args.k}; "
          f"times are the best of 5 runs")
    print(f"target alone: {len(alone)} tokens, {len(alone)} target passes, {t_alone:.3f} s")
    print(f"draft alone:  {len(alone)} tokens, {len(alone)} draft passes, {t_draft:.3f} s")
    print(f"speculative:  {len(spec)} tokens, {st['target_passes']} target passes + {st['draft_passes']} draft "
          f"passes, {t_spec:.3f} s")
    for line in report(args.k, len(spec), st, t_alone, t_draft, t_spec):
        print(line)
    if args.temperature <= 0:
        print(f"same tokens as the target alone: {'yes' if spec == alone else 'NO'}")
    print(f"--- speculative output ---\n{args.prompt}{tok.decode(spec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
