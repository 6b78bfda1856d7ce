"""`ddtree-server generate`: one completion from the command line, with decoding statistics.

The text streams to stdout as it is accepted; the statistics go to stderr as a rich table. With
``--json`` nothing streams and one JSON document ``{"text", "token_ids", "finish_reason", "stats",
"model", "messages"}`` goes to stdout. Models load exactly as for ``serve`` (ServerConfig defaults:
the embedded SmolLM2 GGUF, the shipped drafter when present; cuda + bf16 when available).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ddtree_server.commands.options import config_errors, seed_range, top_p_range


def _stats_table(stats: dict, model: str):
    from rich.table import Table

    table = Table(title=f"decoding statistics ({model})", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.4f}" if "seconds" in key else f"{value:.2f}"
        table.add_row(key, "-" if value is None else str(value))
    return table


def generate(
    prompt: str = typer.Argument(..., help="Prompt text (a user message with --chat, raw text with --raw)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Hugging Face model folder of the target."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="GGUF file of the target."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="z-lab DFlash drafter folder."),
    mode: Optional[str] = typer.Option(None, "--mode", help="ar | dflash | ddtree (default: ddtree with a drafter)."),
    tree_budget: Optional[int] = typer.Option(None, "--tree-budget", min=1, help="DDTree node budget."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Maximum new tokens."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy (exact)."),
    top_p: float = typer.Option(1.0, "--top-p", callback=top_p_range, help="Nucleus sampling mass, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, "--seed", callback=seed_range, help="Sampling seed (signed 64-bit)."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Apply the chat template (default) or not."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: cuda if available)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32 | bf16 (default: bf16 on cuda, fp32 on cpu)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context window in tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of streaming."),
) -> None:
    """Generate one completion and print the decoding statistics."""
    from rich.console import Console
    from pydantic import ValidationError

    from ddtree_server.config import ServerConfig

    err = Console(stderr=True)
    try:
        config = ServerConfig(target=target, gguf=gguf, drafter=drafter, mode=mode, tree_budget=tree_budget,
                              device=device, dtype=dtype, max_model_len=max_model_len,
                              max_running=1)  # one request: one cache slot
    except ValidationError as exc:
        for line in config_errors(exc):
            err.print(line, markup=False, highlight=False)
        raise typer.Exit(2) from None
    from ddtree_server.engine.factory import engine_from_config
    from ddtree_server.engine.params import SamplingParams

    try:
        with err.status(f"loading model on {config.device} ({config.dtype})"):
            engine = engine_from_config(config)
        for line in engine.messages:
            err.print(f"[dim]{line}[/dim]")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop=list(stop or []))
        ids = engine.encode(prompt, chat=chat)
        events = engine.generate(ids, params, mode=mode, tree_budget=tree_budget)
    except Exception as exc:  # noqa: BLE001 - one clean line for any load / argument error
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    text, token_ids, last = "", [], None
    for last in events:
        text += last.text
        token_ids += last.token_ids
        if not as_json and last.text:
            sys.stdout.write(last.text)
            sys.stdout.flush()
    stats = last.stats.to_dict()
    if as_json:
        doc = {"model": engine.model_id, "text": text, "token_ids": token_ids,
               "finish_reason": last.finish_reason, "stats": stats, "messages": engine.messages}
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        sys.stdout.write("\n")
        err.print(_stats_table({"finish_reason": last.finish_reason, **stats}, engine.model_id))


def register(app: typer.Typer) -> None:
    """Add ``generate`` to the Typer app."""
    app.command("generate")(generate)
