"""xgrammar vs llguidance on the default model's tokenizer: what the constrained-decoding choice
rests on (docs/constrained.md, "Why xgrammar").

`python -m ddtree_server.bench.grammar_libs --out DIR [--repeats 20]`

Per library and schema (the constrained benchmark's four schemas, `{"type": "object"}` and a
pathological 1,000-property object): compile time (cold: a new compiler, no cache), the mean time
of one next-token mask along a valid JSON document (tokenised by the model's tokenizer), the time
to mask a 64-node draft tree (xgrammar: its native ``traverse_draft_tree``; llguidance: the same
depth-first walk in Python with ``consume_token`` / ``rollback``), and whether rollback is
available. Needs the ``bench`` extra (llguidance). Writes ``grammar_libs.json`` and ``.md``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import typer

WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
DOCS = {"person": {"name": "Ada Lovelace", "age": 36, "city": "London", "hobbies": ["math", "poetry"],
                   "employed": False},
        "recipe": {"title": "Pancakes", "servings": 4, "ingredients": [{"item": "flour", "amount": "200 g"}],
                   "steps": ["Mix.", "Fry."]},
        "weather": {"reports": [{"city": c, "temperature_c": 12.5, "sky": "rain"} for c in ("Oslo", "Rome", "Lima")]},
        "books": {"books": [{"title": t, "author": a, "year": y} for t, a, y in (
            ("Emma", "Jane Austen", 1815), ("Dracula", "Bram Stoker", 1897), ("Ulysses", "James Joyce", 1922),
            ("Beloved", "Toni Morrison", 1987))]},
        "object": {"a": [1, 2, {"b": "c"}], "d": None}}


def _schemas():
    from ddtree_server.bench.constrained import PROMPTS

    names = ("person", "recipe", "weather", "books")
    return {**{n: s for n, (_, s) in zip(names, PROMPTS)}, "object": {"type": "object"}, "wide1000": WIDE}


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise RuntimeError(why)


def _tree(doc_ids, n=64, seed=0):
    """A draft tree of n nodes around the document's tokens: a spine of the true tokens with
    random siblings (some valid, most not)."""
    rng = random.Random(seed)
    parents, tokens = [-1], [doc_ids[0]]
    spine, depth = 0, 0
    for i in range(1, n):
        if depth + 1 < len(doc_ids) and rng.random() < 0.5:
            depth += 1
            parents.append(spine)
            tokens.append(doc_ids[depth])
            spine = i
        else:
            parents.append(rng.randrange(i))
            tokens.append(rng.randrange(1000, 40000))
    return parents, tokens


class XG:
    name = "xgrammar"
    separators = (", ", ": ")   # any_whitespace=False

    def __init__(self, tok, vocab):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])

    def compile(self, schema):
        return self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False).compile_json_schema(
            json.dumps(schema), any_whitespace=False)

    def mask_walk(self, compiled, ids):
        m, bm = self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab)
        t0 = time.perf_counter()
        for t in ids:
            m.fill_next_token_bitmask(bm)
            _check(m.accept_token(t), "xgrammar refused a token of the valid document")
        return (time.perf_counter() - t0) / len(ids)

    def tree(self, compiled, parents, tokens):
        import torch

        from ddtree_server.constrained.matcher import child_sibling

        m = self.xgr.GrammarMatcher(compiled)
        _check(m.accept_token(tokens[0]), "xgrammar refused the root")   # the root is committed
        bm = self.xgr.allocate_token_bitmask(len(parents), self.vocab)
        first, sib = child_sibling(parents)
        t0 = time.perf_counter()
        m.traverse_draft_tree(first, sib, torch.tensor(tokens), bm)
        return time.perf_counter() - t0


class LLG:
    name = "llguidance"
    separators = (",", ":")     # whitespace_flexible False

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        m.compute_bitmask()   # llguidance builds lazily: the first mask is part of the compile
        return grammar

    def mask_walk(self, grammar, ids):
        m = self.llg.LLMatcher(self.tok, grammar)
        t0 = time.perf_counter()
        for t in ids:
            m.compute_bitmask()
            _check(m.consume_token(t), m.get_error())
        return (time.perf_counter() - t0) / len(ids)

    def tree(self, grammar, parents, tokens):
        m = self.llg.LLMatcher(self.tok, grammar)
        _check(m.consume_token(tokens[0]), m.get_error())   # the root is committed
        children = [[] for _ in parents]
        for i in range(1, len(parents)):
            children[parents[i]].append(i)
        t0 = time.perf_counter()
        stack = [(0, False)]
        while stack:   # depth first: mask a node, visit its accepted children, roll back
            node, leaving = stack.pop()
            if leaving:
                m.rollback(1)
                continue
            if node:
                if m.validate_tokens([tokens[node]]) != 1:   # refused: skip the subtree
                    continue
                m.consume_token(tokens[node])
                stack.append((node, True))
            m.compute_bitmask()
            stack.extend((c, False) for c in reversed(children[node]))
        return time.perf_counter() - t0


def run(repeats: int) -> dict:
    from transformers import AutoTokenizer

    from ddtree_server.models.default import default_gguf_path
    from ddtree_server.models.load import gguf_to_folder

    tok = AutoTokenizer.from_pretrained(gguf_to_folder(default_gguf_path()))
    rows = []
    for lib in (XG(tok, 49152), LLG(tok, 49152)):
        for name, schema in _schemas().items():
            t0 = time.perf_counter()
            try:
                compiled = lib.compile(schema)
            except Exception as exc:  # noqa: BLE001 - a refusal is a result here
                rows.append({"library": lib.name, "schema": name, "error": str(exc)[:200]})
                continue
            row = {"library": lib.name, "schema": name, "compile_ms": 1e3 * (time.perf_counter() - t0),
                   "rollback": True}
            if name in DOCS:
                ids = tok.encode(json.dumps(DOCS[name], separators=lib.separators), add_special_tokens=False)
                row["mask_us_per_token"] = 1e6 * statistics.median(lib.mask_walk(compiled, ids) for _ in range(repeats))
                parents, tokens = _tree(ids)
                row["tree64_ms"] = 1e3 * statistics.median(lib.tree(compiled, parents, tokens) for _ in range(repeats))
            rows.append(row)
    return {"rows": rows, "repeats": repeats}


def markdown(report: dict) -> str:
    lines = ["# Grammar libraries on the SmolLM2 tokenizer (49,152 tokens), CPU", "",
             f"Medians of {report['repeats']}. compile: a new compiler without cache (llguidance compiles lazily, "
             "its first mask is included); mask: one next-token mask along a valid document; tree: the masks of "
             "a 64-node draft tree (a valid spine with random siblings) from a committed root; "
             "produced by `python -m ddtree_server.bench.grammar_libs`.", "",
             "| library | schema | compile ms | mask us/token | 64-node tree ms | rollback |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['library']} | {r['schema']} | refused: {r['error']} | | | |")
            continue
        fmt = lambda k, f: format(r[k], f) if k in r else "-"  # noqa: E731
        lines.append(f"| {r['library']} | {r['schema']} | {r['compile_ms']:.1f} | {fmt('mask_us_per_token', '.1f')} | "
                     f"{fmt('tree64_ms', '.3f')} | {r['rollback']} |")
    return "\n".join(lines) + "\n"


def main(out: Path = typer.Option(..., help="Folder for grammar_libs.json and grammar_libs.md."),
         repeats: int = typer.Option(20, min=1, help="Repeats of every timing (median).")) -> None:
    """Compare xgrammar and llguidance (compile, mask per token, 64-node tree, rollback)."""
    report = run(repeats)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_libs.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "grammar_libs.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(main)
