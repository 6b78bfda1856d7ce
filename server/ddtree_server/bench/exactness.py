"""Exactness check on any device: ar vs dflash vs ddtree, greedy, token for token.

`python -m ddtree_server.bench.exactness --gguf G --drafter D --device cuda --dtype fp32 --out F`

The engine runs as served (on CUDA: target and drafter replayed from CUDA graphs), so this is the
GPU counterpart of tests/server/test_exact.py: at temperature 0 every speculative method must give
plain decoding's tokens (docs/ddtree.md §2.4). In fp32 they must be identical; in bf16 kernel choice can
flip near-ties (RESULTS.md "Exactness in bf16"). Writes a JSON report: per prompt and method the
token count, tau and whether the tokens equal ar's, whether the drafter's graphs stayed enabled,
and `all_equal`. Exit code 0 when every output equals ar's, 1 otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue in three sentences.",
    "List five prime numbers greater than 50 and say why each is prime.",
)


def check(engine, prompts, methods, max_new_tokens: int) -> dict:
    """Run every method on every prompt (greedy, through the benchmark's `run_one`); returns the
    report dict (see module docstring). Outputs are compared by the records' token digests."""
    from ddtree_server.bench.runner import Method, run_one

    rows, all_equal = [], True
    for i, text in enumerate(prompts):
        ids = engine.encode(text)
        ref = None
        for mode, budget in methods:
            rec = run_one(engine, ids, Method(mode, budget), max_new_tokens, seed=0)
            ref = rec["output_digest"] if mode == "ar" else ref
            same = ref is not None and rec["output_digest"] == ref
            all_equal &= same or mode == "ar"
            rows.append({"prompt": i, "method": rec["method"], "tokens": rec["tokens"], "tau": rec["tau"],
                         "same_as_ar": same, "wall_s": round(rec["e2e_s"], 3)})
    graphs = getattr(engine.drafter, "enabled", None)
    return {"rows": rows, "all_equal": all_equal, "drafter_graphs_enabled": graphs,
            "target": type(engine.target).__name__, "drafter": type(engine.drafter).__name__}


def main(gguf: Optional[Path] = typer.Option(None, help="Target GGUF (default: the embedded SmolLM2)."),
         drafter: Optional[Path] = typer.Option(None, help="Drafter folder (default: the shipped one)."),
         device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N (auto: cuda if available)."),
         dtype: str = typer.Option("fp32", help="fp32 | bf16."),
         budgets: str = typer.Option("1,16,64,256", help="DDTree budgets to check (>= 1)."),
         max_new_tokens: int = typer.Option(96, min=1, help="Tokens per request."),
         prompts: int = typer.Option(len(PROMPTS), min=1, max=len(PROMPTS), help="How many of the built-in prompts."),
         out: Optional[Path] = typer.Option(None, help="Write the JSON report here.")) -> None:
    """Check that dflash and ddtree reproduce ar's greedy tokens on this device."""
    from ddtree_server.commands.options import budget_list, check_device
    from ddtree_server.engine.factory import load_engine
    from ddtree_server.models.default import DefaultModelError
    from ddtree_server.models.common import TargetLoadError

    if dtype not in ("fp32", "bf16"):
        raise typer.BadParameter(f"--dtype {dtype!r}: use fp32 or bf16")
    device = check_device(device)
    methods = [("ar", None), ("dflash", None)] + [("ddtree", b) for b in budget_list(budgets)]
    try:
        engine = load_engine(gguf=gguf, drafter=drafter, device=device, dtype=dtype, max_running=1)
        if not engine.spec_available:
            raise ValueError("no drafter is loaded: nothing to compare with ar")
        report = check(engine, PROMPTS[:prompts], methods, max_new_tokens)
    except (ValueError, OSError, TargetLoadError, DefaultModelError) as exc:  # bad model files or settings
        typer.echo(f"exactness failed: {exc}", err=True)
        raise typer.Exit(1) from None
    report.update(device=device, dtype=dtype, messages=engine.messages)
    text = json.dumps(report, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
    raise typer.Exit(0 if report["all_equal"] else 1)


if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(main)
