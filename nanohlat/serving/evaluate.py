"""Evaluation: held-out loss, perplexity and bits per byte, and multiple-choice
tasks scored by log-likelihood (the way EleutherAI's lm-evaluation-harness does).

    held-out windows ──model(tokens, targets)──> mean nats per token = val_loss
        perplexity    = exp(val_loss)
        bits_per_byte = val_loss / ln 2 / (bytes per token)      (comparable across tokenizers)

    multiple choice:  context + choice_0 ─┐
                      context + choice_1 ─┼─> sum of log p(choice tokens | context) ─> argmax
                      context + choice_2 ─┘
        acc      : argmax of the summed log-probs
        acc_norm : argmax of the summed log-probs / the choice's length in UTF-8 bytes
                   (a long answer is not punished just for having more tokens)

Nothing is sampled: every number here is a deterministic function of the
weights, the data and the seed, so curves over checkpoints are comparable.

The built-in task ("next_line") needs no download: it is made from the
held-out Python files of the training corpus. Shown a few consecutive lines,
the model must pick the true next line among it and three lines drawn from
other places of the held-out code. The true line and the distractors are drawn
from the same pool of lines, so a model that ignores the context (a randomly
initialised one) scores 25% in expectation, whatever its length preferences.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from nanohlat.config import UserError


# ---------------------------------------------------------------------------
# Held-out loss, perplexity, bits per byte
# ---------------------------------------------------------------------------

def heldout_windows(num_tokens: int, seq_len: int, count: int) -> np.ndarray:
    """Start offsets of `count` windows of seq_len + 1 tokens, spread evenly over
    the whole held-out split (not just its first documents), the same every call.
    count <= 0 means every window."""
    n = max(0, (num_tokens - 1) // seq_len)       # windows that fit; neighbours share one token
    if n == 0:
        raise UserError(f"the held-out split has {num_tokens} tokens, fewer than one window of "
                        f"{seq_len} + 1; use a smaller --seq-len or more --data")
    count = n if count <= 0 else min(count, n)
    # linspace steps are >= 1 when count <= n, so the rounded indices are distinct.
    return np.linspace(0, n - 1, count).round().astype(np.int64) * seq_len


@torch.no_grad()
def heldout_metrics(model, dataset, seq_len: int, batch_size: int = 8, max_batches: int = 16,
                    device=None) -> dict:
    """val_loss (mean nats per target token), perplexity and bits_per_byte over
    batch_size * max_batches held-out windows (max_batches 0: all of them), and
    tokens_scored, how many target tokens that was."""
    device = device or next(model.parameters()).device
    val = dataset.val
    starts = heldout_windows(len(val), seq_len, batch_size * max_batches if max_batches > 0 else 0)
    total_nats, total_tokens = 0.0, 0
    for b in range(0, len(starts), batch_size):
        index = starts[b:b + batch_size, None] + np.arange(seq_len + 1)            # (B, T+1)
        window = torch.from_numpy(val[index].astype(np.int64)).to(device)
        losses = model(window[:, :-1], window[:, 1:])                              # (B, T) nats
        total_nats += losses.double().sum().item()      # one host read per batch
        total_tokens += losses.numel()
    val_loss = total_nats / total_tokens
    # nats/token -> bits/token (/ ln 2) -> bits/byte (/ bytes per token of this split)
    return {"val_loss": val_loss, "perplexity": math.exp(min(val_loss, 700.0)),
            "bits_per_byte": val_loss / math.log(2) / dataset.bytes_per_token("val"),
            "tokens_scored": total_tokens}


# ---------------------------------------------------------------------------
# Log-likelihood of continuations (shared with the lm-evaluation-harness adapter)
# ---------------------------------------------------------------------------

def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids (BOS + context, continuation), the continuation being exactly its text.

    Trailing spaces move from the context to the continuation ("Answer: " +
    "Paris" -> "Answer:" + " Paris"): SentencePiece starts pieces with the
    space, so that is how the text tokenises in running prose. Then, as the
    harness does, the whole string is tokenised once and split where the
    context's own tokens end, so the continuation gets the tokenisation it
    would have in a document. When a piece straddles the boundary (":\\n" or
    "\\n#"), that split does not exist and the two parts are tokenised apart.
    """
    n_spaces = len(context) - len(context.rstrip(" "))
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    ctx = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else tokenizer.encode(continuation)
    # BOS first, as every training document began (and a context to condition on when it is empty).
    return [tokenizer.bos_id] + ctx, cont


@torch.no_grad()
def score_continuations(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16,
                        device=None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context) in nats, is_greedy) for each
    (context_ids, continuation_ids) pair; is_greedy: every continuation token is
    the model's argmax. context_ids must not be empty (start it with BOS).

    Sequences longer than the model's max_seq_len lose tokens from the left.
    They are sorted longest first and batched with right padding: a batch is
    as long as its longest member, and neighbours in length share batches.
    Padding sits after each sequence, so causal attention never lets a real
    token see it.
    """
    device = device or next(model.parameters()).device
    vocab, max_len = model.cfg.vocab_size, model.cfg.max_seq_len
    # On XLA each new (B, T) shape compiles a graph: round T up to a bucket to bound that.
    bucket = 64 if torch.device(device).type == "xla" else 1
    seqs = []
    for ctx, cont in pairs:
        full = (list(ctx) + list(cont))[-(max_len + 1):]        # inputs are full[:-1]: <= max_len
        seqs.append((full, min(len(cont), len(full) - 1)))
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    results: list = [None] * len(seqs)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        T = min(max_len, -(-(len(seqs[idx[0]][0]) - 1) // bucket) * bucket)
        C = max(1, max(seqs[i][1] for i in idx))        # the longest continuation in the batch
        inputs = torch.zeros(len(idx), T, dtype=torch.long)             # (B, T); pad id 0, never scored
        positions = torch.zeros(len(idx), C, dtype=torch.long)          # (B, C) the last C real positions
        targets = torch.zeros(len(idx), C, dtype=torch.long)            # (B, C) the tokens they predict
        scored = torch.zeros(len(idx), C, dtype=torch.bool)             # (B, C) those in the continuation
        for r, i in enumerate(idx):
            full, n_cont = seqs[i]
            L = len(full) - 1
            inputs[r, :L] = torch.tensor(full[:-1])
            # Position p predicts token p + 1: positions L - C .. L - 1 predict the last C tokens.
            positions[r] = torch.arange(L - C, L).clamp(min=0)
            targets[r] = torch.tensor(full)[positions[r] + 1]
            scored[r, C - n_cont:] = True
        logits = model(inputs.to(device))                                # (B, T, V)
        # Only the (B, C) continuation positions need a softmax: far less memory
        # traffic than normalising all (B, T, V) logits when T >> C.
        positions, targets, scored = positions.to(device), targets.to(device), scored.to(device)
        logits = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])).float()   # (B, C, V)
        logits[..., vocab:] = float("-inf")                              # padded vocabulary never wins
        token_logp = logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)   # (B, C)
        hit = logits.argmax(-1) == targets                                                        # (B, C)
        sums = torch.where(scored, token_logp, 0.0).double().sum(-1)                            # (B,)
        greedy = (hit | ~scored).all(-1)                                                          # (B,)
        for r, (s, g) in enumerate(zip(sums.tolist(), greedy.tolist())):
            results[idx[r]] = (s, g)
    return results


# ---------------------------------------------------------------------------
# Multiple-choice tasks
# ---------------------------------------------------------------------------

@dataclass
class Example:
    context: str
    choices: list[str]
    label: int            # index of the correct choice


@dataclass
class Task:
    name: str
    examples: list[Example]


def load_task_file(path: str) -> Task:
    """A JSONL file, one {"context": str, "choices": [str, ...], "label": int} per line."""
    if os.path.exists(path) and not os.path.isfile(path):   # a folder, a FIFO, a device
        raise UserError(f"--task {path!r} is not a regular file; give 'builtin' or a .jsonl file")
    if not os.path.isfile(path):
        raise UserError(f"--task {path!r} does not exist; give 'builtin' or a .jsonl file whose lines look like "
                        f'{{"context": "...", "choices": ["...", "..."], "label": 0}}')
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                context, choices, label = d["context"], d["choices"], d["label"]
                if not isinstance(context, str):
                    raise TypeError(f"'context' is a {type(context).__name__}, not a string")
                if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)):
                    raise TypeError("'choices' is not a list of at least 2 strings")
                if not all(c.strip() for c in choices):   # an empty choice has log-likelihood 0: it always wins
                    raise TypeError("a choice is empty or blank; every choice needs at least one token")
                if not (type(label) is int and 0 <= label < len(choices)):
                    raise TypeError(f"'label' {label!r} is not an index into the {len(choices)} choices")
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{path}:{lineno}: not a task example ({type(e).__name__}: {e}); each line must "
                                f'look like {{"context": "...", "choices": ["...", "..."], "label": 0}}') from None
            examples.append(Example(context, choices, label))
    if not examples:
        raise UserError(f"--task {path!r} has no examples; write one JSON object per line")
    name = os.path.splitext(os.path.basename(path))[0]
    return Task(name, examples)


def fewshot_context(task: Task, i: int, shots: int, seed: int) -> str:
    """Example i's context after `shots` solved examples (context + correct
    choice) drawn from the task's other examples, separated by blank lines.
    The draw depends on (seed, i) only, so it is the same every run."""
    ex = task.examples[i]
    if shots <= 0:
        return ex.context
    others = [j for j in range(len(task.examples)) if j != i]
    if shots > len(others):
        raise UserError(f"--shots {shots} needs more examples than task {task.name!r} has ({len(task.examples)})")
    picked = np.random.default_rng([seed, i]).choice(others, size=shots, replace=False)
    demos = [task.examples[j].context + task.examples[j].choices[task.examples[j].label] for j in picked]
    return "\n\n".join(demos + [ex.context])


def evaluate_task(model, tokenizer, task: Task, shots: int = 0, seed: int = 0, batch_size: int = 16,
                  device=None) -> dict:
    """acc and acc_norm (with standard errors) of `model` on `task`, plus the chance level."""
    pairs = []
    for i, ex in enumerate(task.examples):
        context = fewshot_context(task, i, shots, seed)
        pairs += [encode_pair(tokenizer, context, choice) for choice in ex.choices]
    scores = score_continuations(model, pairs, batch_size, device)
    correct, correct_norm, k = [], [], 0
    for ex in task.examples:
        logp = np.array([s for s, _ in scores[k:k + len(ex.choices)]])
        nbytes = np.array([max(1, len(c.encode("utf-8"))) for c in ex.choices])
        correct.append(int(np.argmax(logp)) == ex.label)
        correct_norm.append(int(np.argmax(logp / nbytes)) == ex.label)
        k += len(ex.choices)
    n = len(task.examples)

    def stderr(hits):  # standard error of a mean of 0/1 outcomes (as the harness reports)
        p = float(np.mean(hits))
        return math.sqrt(p * (1 - p) / max(1, n - 1))
    return {"acc": float(np.mean(correct)), "acc_stderr": stderr(correct),
            "acc_norm": float(np.mean(correct_norm)), "acc_norm_stderr": stderr(correct_norm),
            "chance": float(np.mean([1 / len(ex.choices) for ex in task.examples])),
            "examples": n, "shots": shots}


# ---------------------------------------------------------------------------
# The built-in task: pick the true next line of held-out Python code
# ---------------------------------------------------------------------------

def next_line_task(documents: list[str], num_examples: int = 200, seed: int = 0, context_lines: int = 4,
                   num_choices: int = 4, min_chars: int = 8, max_chars: int = 200) -> Task:
    """About num_examples "which line comes next?" questions from `documents`.

    A line can be an answer or a distractor when it has at least min_chars
    non-blank characters (not blank, not "else:" or ")") and at most max_chars.
    Answers are lines at uniformly drawn positions; distractors are lines at
    uniformly drawn positions too, away from the answer's own neighbourhood
    and different in text. Both come from one pool, so without the context
    the correct choice cannot be told from the others: chance is 1 / num_choices
    (requiring four different texts tilts this only for lines that repeat
    very often, a negligible effect in real code). A line keeps its
    indentation: that is part of what a code model learns to predict.
    """
    rng = np.random.default_rng([seed, 0x6E6C])     # "nl": a stream of its own
    docs = [d.split("\n") for d in documents]
    pool = [(d, i) for d, lines in enumerate(docs) for i, line in enumerate(lines)
            if min_chars <= len(line.strip()) and len(line) <= max_chars]
    # Answer positions also need context_lines lines before them, not all blank.
    answers = [(d, i) for d, i in pool if i >= context_lines and any(s.strip() for s in docs[d][i - context_lines:i])]
    if len(pool) < 4 * num_choices or not answers:
        raise UserError(f"the held-out documents have only {len(pool)} usable lines, too few for the built-in "
                        f"next-line task; use more --data (or a JSONL --task)")
    examples = []
    for a in rng.permutation(len(answers))[:num_examples]:
        d, i = answers[a]
        true = docs[d][i]
        choices = [true]
        for _ in range(100 * num_choices):      # bounded: a corpus of one repeated line has no distractors
            if len(choices) == num_choices:
                break
            dd, ii = pool[rng.integers(len(pool))]
            line = docs[dd][ii]
            if not ((dd == d and abs(ii - i) <= context_lines) or line in choices):
                choices.append(line)
        if len(choices) < num_choices:
            continue
        perm = rng.permutation(num_choices)
        context = "\n".join(docs[d][i - context_lines:i]) + "\n"
        examples.append(Example(context, [choices[p] for p in perm], int(np.argmax(perm == 0))))
    if not examples:
        raise UserError("the held-out documents have too few distinct lines for the built-in next-line task; "
                        "use more --data (or a JSONL --task)")
    return Task("next_line", examples)
