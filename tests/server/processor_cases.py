"""Shared cases of the logits-processing tests: schemas, penalty settings, and a runner that
decodes one request in a given mode and collects tokens, logprobs and statistics.

The schemas are bounded (string lengths, integer ranges, array sizes) so that a tiny random
target, which has no reason to close a string, still finishes its JSON.
"""

from __future__ import annotations

from ddtree_server.engine.sampling import SamplingParams

SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 8, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    "arrays_enums": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 3, "maxItems": 6},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
                  "minItems": 2, "maxItems": 4}}, "required": ["colors", "sizes"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "minLength": 4, "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
            "required": ["id", "address"]},
        "level": {"enum": ["low", "mid", "high"]}}, "required": ["user", "level"]},
    "strict": {"type": "object", "additionalProperties": False, "properties": {
        "title": {"type": "string", "minLength": 10, "maxLength": 20},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "kind": {"enum": ["a", "b"]}}, "required": ["title", "score", "kind"]},
}

PENALTIES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "repetition": dict(repetition_penalty=1.8),
    "bias": dict(logit_bias={32: 4.0, 101: -100.0, 116: 2.5}),
    "all": dict(presence_penalty=-0.7, frequency_penalty=0.9, repetition_penalty=1.3, logit_bias={97: 3.0}),
}

SPEC_CASES = [("ddtree", 1), ("ddtree", 16), ("ddtree", 64), ("dflash", None)]


def decode(engine, ids, *, mode=None, budget=None, max_tokens=96, **params):
    """(tokens, logprobs, stats) of one request."""
    sp = SamplingParams(max_tokens=max_tokens, **params)
    toks, lps, stats = [], [], None
    for ev in engine.generate(ids, sp, mode=mode, tree_budget=budget):
        toks += ev.token_ids
        lps += ev.logprobs or []
        stats = ev.stats or stats
    return toks, lps, stats


def first_diff(a, b) -> int | None:
    """Index of the first difference of two token lists (None when equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
