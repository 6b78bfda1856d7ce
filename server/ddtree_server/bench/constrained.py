"""Constrained decoding benchmark: json_schema output with DDTree / DFlash vs constrained plain
decoding, and the grammar's cost per round.

`python -m ddtree_server.bench.constrained --out DIR [--device auto] [--dtype bf16] [--budgets 16,64]
[--prompts 4] [--max-new-tokens 256] [--repeats 1]`

Every prompt asks for a JSON document and carries a schema (response_format json_schema); each
method decodes it greedily through the server's Engine: constrained ar, dflash and ddtree (each
budget), and unconstrained ar / ddtree as the reference speed. Per record: tokens, rounds, tau,
decode seconds, tokens/s, whether the tokens equal constrained ar's and whether the text validates
against the schema (``jsonschema``); the grammar's host time per round (xgrammar's tree traversal,
``TreeMatcher.masks``) and the whole processing step per round (masks + applying them to the
logits; on CUDA synchronised, so it includes the device work). Writes ``constrained.json`` and
``constrained.md`` under DIR; exit code 1 when a constrained output differs from ar's.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Optional

import typer

PROMPTS = (
    ("Invent a person and describe them as JSON.",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
         "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
         "employed": {"type": "boolean"}}, "required": ["name", "age", "city", "hobbies", "employed"]}),
    ("Give a recipe for pancakes as JSON.",
     {"type": "object", "properties": {
         "title": {"type": "string"}, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
         "ingredients": {"type": "array", "items": {"type": "object", "properties": {
             "item": {"type": "string"}, "amount": {"type": "string"}}, "required": ["item", "amount"]},
             "maxItems": 8},
         "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
      "required": ["title", "servings", "ingredients", "steps"]}),
    ("Report the weather for three cities as JSON.",
     {"type": "object", "properties": {"reports": {"type": "array", "items": {"type": "object", "properties": {
         "city": {"type": "string"}, "temperature_c": {"type": "number"},
         "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}}, "required": ["city", "temperature_c", "sky"]},
         "minItems": 3, "maxItems": 3}}, "required": ["reports"]}),
    ("List four classic novels with their authors and publication years as JSON.",
     {"type": "object", "properties": {"books": {"type": "array", "items": {"type": "object", "properties": {
         "title": {"type": "string"}, "author": {"type": "string"},
         "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, "required": ["title", "author", "year"]},
         "minItems": 4, "maxItems": 4}}, "required": ["books"]}),
)


class GrammarClock:
    """Times ``TreeMatcher.masks`` and ``RequestProcessor.process`` while active (wraps the class
    methods; synchronises CUDA at the end of ``process`` so the device work is included)."""

    def __init__(self, cuda: bool):
        self.cuda, self.mask_s, self.process_s, self.calls = cuda, 0.0, 0.0, 0

    @contextlib.contextmanager
    def active(self):
        import torch

        from ddtree_server.constrained.matcher import TreeMatcher
        from ddtree_server.engine.processors import RequestProcessor

        masks, process = TreeMatcher.masks, RequestProcessor.process

        def timed_masks(matcher, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return masks(matcher, *args, **kwargs)
            finally:
                self.mask_s += time.perf_counter() - t0

        def timed_process(proc, *args, **kwargs):
            t0 = time.perf_counter()
            out = process(proc, *args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.process_s += time.perf_counter() - t0
            self.calls += 1
            return out

        TreeMatcher.masks, RequestProcessor.process = timed_masks, timed_process
        try:
            yield self
        finally:
            TreeMatcher.masks, RequestProcessor.process = masks, process


def run_method(engine, ids, grammar, mode, budget, max_new_tokens, cuda) -> tuple[list[int], dict]:
    from ddtree_server.engine.params import SamplingParams

    clock = GrammarClock(cuda)
    toks, stats = [], None
    with clock.active():
        for ev in engine.generate(ids, SamplingParams(max_tokens=max_new_tokens, grammar=grammar), mode=mode,
                                  tree_budget=budget):
            toks += ev.token_ids
            stats = ev.stats or stats
    rounds = max(stats.decode_rounds, 1)
    return toks, {"tokens": stats.generated_tokens, "rounds": stats.decode_rounds,
                  "tau": stats.mean_acceptance_length or 1.0, "decode_s": stats.decode_seconds,
                  "tokens_per_s": stats.tokens_per_second or 0.0,
                  "grammar_mask_ms_per_round": 1e3 * clock.mask_s / rounds,
                  "grammar_process_ms_per_round": 1e3 * clock.process_s / rounds}


def bench(engine, prompts, budgets, max_new_tokens: int, repeats: int, cuda: bool) -> dict:
    """Records for every prompt x method x repeat, per-method medians and ``all_equal``."""
    import jsonschema

    methods = [("ar", None, True), ("dflash", None, True)] + [("ddtree", b, True) for b in budgets]
    methods += [("ar", None, False), ("ddtree", max(budgets), False)]
    rows, all_equal = [], True
    for i, (text, schema) in enumerate(prompts):
        ids = engine.encode(text + " Schema: " + json.dumps(schema))
        grammar = engine.grammars.json_schema(schema)
        engine.generate_text(ids, _params(8, grammar))   # warm-up
        ref = None
        for mode, budget, constrained in methods:
            for r in range(repeats):
                toks, rec = run_method(engine, ids, grammar if constrained else None, mode, budget,
                                       max_new_tokens, cuda)
                name = f"{mode}{'' if budget is None else f'@{budget}'}{'' if constrained else ' (free)'}"
                out = engine.tokenizer.decode(toks, skip_special_tokens=True)
                valid = None
                if constrained:
                    try:
                        jsonschema.validate(json.loads(out), schema)
                        valid = True
                    except (ValueError, jsonschema.ValidationError):
                        valid = False
                    if mode == "ar" and ref is None:
                        ref = toks
                    all_equal &= toks == ref
                rows.append({"prompt": i, "method": name, "constrained": constrained, "repeat": r,
                             "same_as_ar": (toks == ref) if constrained else None, "valid": valid, **rec})
    return {"rows": rows, "summary": summarise(rows), "all_equal": all_equal}


def _params(n, grammar):
    from ddtree_server.engine.params import SamplingParams

    return SamplingParams(max_tokens=n, grammar=grammar)


def summarise(rows) -> list[dict]:
    """Per method: medians over prompts and repeats; speedup = median tokens/s over constrained ar's."""
    out = []
    names = list(dict.fromkeys(r["method"] for r in rows))
    base = statistics.median(r["tokens_per_s"] for r in rows if r["method"] == "ar") or 1.0
    for name in names:
        sel = [r for r in rows if r["method"] == name]
        med = {k: statistics.median(r[k] for r in sel) for k in
               ("tau", "tokens_per_s", "grammar_mask_ms_per_round", "grammar_process_ms_per_round", "tokens")}
        out.append({"method": name, **{k: round(v, 3) for k, v in med.items()},
                    "speedup_vs_constrained_ar": round(med["tokens_per_s"] / base, 3),
                    "all_same_as_ar": all(r["same_as_ar"] is not False for r in sel),
                    "all_valid": all(r["valid"] is not False for r in sel)})
    return out


def markdown(report: dict) -> str:
    lines = [f"# Constrained decoding (json_schema): {report['device']}, {report['dtype']}", "",
             f"{report['prompts']} prompts x {report['repeats']} repeats, greedy, at most {report['max_new_tokens']} "
             f"new tokens; medians. Grammar cost per round: xgrammar's tree traversal (mask) and the whole "
             f"processing step (mask + apply). All constrained outputs equal constrained ar: "
             f"{report['all_equal']}.", "",
             "| method | tau | tok/s | speedup vs constrained ar | mask ms/round | process ms/round | "
             "tokens | = ar | valid |", "|---|---|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        lines.append(f"| {s['method']} | {s['tau']:.2f} | {s['tokens_per_s']:.1f} | "
                     f"{s['speedup_vs_constrained_ar']:.2f}x | {s['grammar_mask_ms_per_round']:.3f} | "
                     f"{s['grammar_process_ms_per_round']:.3f} | "
                     f"{s['tokens']:.0f} | {s['all_same_as_ar']} | {s['all_valid']} |")
    return "\n".join(lines) + "\n"


def main(out: Path = typer.Option(..., help="Folder for constrained.json and constrained.md."),
         gguf: Optional[Path] = typer.Option(None, help="Target GGUF (default: the embedded SmolLM2)."),
         drafter: Optional[Path] = typer.Option(None, help="Drafter folder (default: the shipped one)."),
         device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N."),
         dtype: str = typer.Option("fp32", help="fp32 | bf16."),
         budgets: str = typer.Option("16,64", help="DDTree budgets (>= 1)."),
         max_new_tokens: int = typer.Option(256, min=1, help="Most tokens per request."),
         prompts: int = typer.Option(len(PROMPTS), min=1, max=len(PROMPTS), help="How many built-in prompts."),
         repeats: int = typer.Option(1, min=1, help="Runs of every prompt and method.")) -> None:
    """Constrained json_schema decoding: DDTree / DFlash vs constrained plain decoding."""
    from ddtree_server.commands.options import budget_list, check_device
    from ddtree_server.engine.factory import load_engine

    device = check_device(device)
    engine = load_engine(gguf=gguf, drafter=drafter, device=device, dtype=dtype)
    if not engine.spec_available:
        typer.echo("no drafter is loaded: nothing to compare with ar", err=True)
        raise typer.Exit(1)
    report = bench(engine, PROMPTS[:prompts], budget_list(budgets), max_new_tokens, repeats,
                   cuda=str(device).startswith("cuda"))
    report.update(device=str(device), dtype=dtype, prompts=prompts, repeats=repeats,
                  max_new_tokens=max_new_tokens, messages=engine.messages)
    out.mkdir(parents=True, exist_ok=True)
    (out / "constrained.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "constrained.md").write_text(markdown(report))
    print(markdown(report))
    raise typer.Exit(0 if report["all_equal"] else 1)


if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(main)
