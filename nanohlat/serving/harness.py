"""EleutherAI lm-evaluation-harness adapter: a nanohlat model as harness model "nanohlat".

    pip install lm_eval          # optional: ~40 packages, ~0.5 GB (datasets, pandas, pyarrow, sklearn, ...)
    python -m nanohlat.harness --model nanohlat --model_args path=out --tasks my_task.yaml ...
    python -m nanohlat.harness --model nanohlat --model_args path=out --device cuda --tasks hellaswag

`python -m nanohlat.harness` is the harness's own command line (`lm-eval`) with
this model registered first. Named harness tasks (hellaswag, arc_easy, ...)
download their data sets from the Hugging Face Hub on first use; a task whose
YAML or dict config points `dataset_path: json` at local files runs offline
(tests/serving/test_eval.py does exactly that). From Python:

    from nanohlat.serving.harness import NanoHLATLM
    lm_eval.simple_evaluate(model=NanoHLATLM(path="out"), tasks=[...])

All scoring goes through nanohlat.serving.evaluate (encode_pair, score_continuations),
so a harness multiple-choice task and the same examples run by eval.py agree
to the last bit.
"""

from __future__ import annotations

import sys

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:   # optional dependency: say what to install, not just what failed
    raise ImportError(f"nanohlat.serving.harness needs the lm-evaluation-harness: pip install lm_eval ({e})") from None

from nanohlat.serving.evaluate import encode_pair, score_continuations
from nanohlat.serving.generate import generate
from nanohlat.system import cli


@register_model("nanohlat")
class NanoHLATLM(LM):
    """loglikelihood, loglikelihood_rolling and (greedy) generate_until on one whole model."""

    def __init__(self, path: str = "", model=None, tokenizer=None, batch_size=16, device: str = "auto", **_):
        super().__init__()
        if model is None:   # from the command line: --model_args path=RUN_OR_CHECKPOINT
            from nanohlat.run.data import load_tokenizer
            from nanohlat.device import get_device
            from nanohlat.serving.generate import load_model   # its config, size and finite weights checked
            # the harness's --device: None, "cpu", "cuda", "cuda:0", ... (nanohlat picks the index)
            model, manifest = load_model(path or "out", get_device((device or "auto").split(":")[0]))
            tokenizer = load_tokenizer(manifest["tokenizer"])
        self.model, self.tokenizer = model.eval(), tokenizer
        # The harness passes "auto" (find the largest batch that fits) or a number.
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.max_len = model.cfg.max_seq_len

    @property
    def device(self):
        return next(self.model.parameters()).device

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tokenizer, context, continuation) for context, continuation in
                 (r.args for r in requests)]
        return score_continuations(self.model, pairs, self.batch_size)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Log-likelihood of whole documents: every token predicted once, in windows of
        max_seq_len that each get as much preceding context as fits (the harness's rule)."""
        out = []
        for r in requests:
            ids = self.tokenizer.encode(r.args[0])
            windows = [make_disjoint_window(w) for w in
                       get_rolling_token_windows(ids, self.tokenizer.bos_id, self.max_len, context_len=1)]
            out.append(sum(s for s, _ in score_continuations(self.model, windows, self.batch_size)))
        return out

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        """Greedy continuation of each context until a stop string, EOS or max_gen_toks."""
        out = []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = [self.tokenizer.bos_id] + self.tokenizer.encode(context)
            ids = ids[-max(1, self.max_len - max_new):]          # leave room to generate
            new, text = [], ""
            for [token] in generate(self.model, [ids], max_new):     # greedy, one row, a token per step
                if token == self.tokenizer.eos_id:
                    break
                new.append(token)
                text = self.tokenizer.decode(new)        # decode the whole tail: pieces can split bytes
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


@cli.command
def main() -> int:
    """lm-eval's command line on nanohlat's model; a bad path=, a device this
    machine lacks: one line, exit 2, as every command (system/cli.py)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "python -m nanohlat.harness"
    # the harness's own default device is "cuda:0"; nanohlat's is auto (what this machine has)
    if not any(a == "--device" or a.startswith("--device=") for a in sys.argv[1:]):
        sys.argv += ["--device", "auto"]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
