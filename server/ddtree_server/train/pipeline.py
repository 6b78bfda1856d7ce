"""`train-drafter` end to end: target -> clean prompts -> self-generated data -> training -> state.

Layout of the folders:
  work_dir/data/shard_*.pt    generated training sequences (resumable on the same machine, data.py)
  work_dir/val/shard_*.pt     greedy answers to the validation prompts
  work_dir/train_state.pt     fp32 weights + optimizer + step (exact --resume on the same machine)
  out_dir/config.json, model.safetensors   the servable z-lab drafter (bf16)
  out_dir/summary.json        settings, data counts, timings, final validation metrics, versions
  state_dir/                  the returnable state for a fresh machine (train/resume.py), with
                              train_log.jsonl; without state_dir the log goes to out_dir

Prompts: ShareGPT V3 (train/prompts.py) minus every prompt that copies an evaluation prompt
(train/contamination.py; the check needs the four evaluation wheels). The last `val_prompts` of the
list are the validation prompts, answered greedily (as the benchmark decodes) and never trained on;
the rest form the job pool of data.py, answered from the cursor of the carried state on.

Default drafter for SmolLM2-135M (30 layers, hidden 576): 3 draft layers with the target's widths
(9/3 heads, head_dim 64, MLP 1536) fed by target layers [1, 10, 19, 27]: one early layer (token
identity), two evenly spaced middle layers, and layer 27 = T-3, the deepest layer the reference
default rule uses (the last two layers specialise in the output distribution). Four ids instead of
three cost only 0.33 M parameters in `fc`; the whole drafter is 11.95 M parameters = 23.90 MB in
bf16, under the 24 MB limit (`--max-mb`).

Mask token for SmolLM2: `<empty_output>` (id 16), a reserved control token of its StarCoder-style
vocabulary that the chat template never emits and the instruct model never produces (responses
containing the mask id are dropped from training anyway). Other targets must name one explicitly.
"""

from __future__ import annotations

from typing import Callable

from ddtree_server.train.inputs import PipelineOptions
from ddtree_server.train.session import Session


def run(opts: PipelineOptions, report: Callable[[str, dict], None] = lambda kind, rec: None,
        should_stop: Callable[[], bool] | None = None) -> dict:
    """Run the pipeline; report(kind, record) receives "stage" / "gen" / "log" / "save" events;
    should_stop() (e.g. set by SIGTERM) ends generation and training early, with a final save.
    Returns the summary dict (also written to out_dir/summary.json)."""
    return Session(opts, report, should_stop or (lambda: False)).run()

