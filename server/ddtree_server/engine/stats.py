"""DecodeStats: the per-request decoding statistics (the `decoding` object of every API response).

Pure (no torch), so that api/openapi.py can describe the same fields without loading the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DecodeStats:
    """Per-request decoding statistics.

    The prefill forward yields the first token; every later target forward is one *decode round*
    (ar: one token; dflash/ddtree: the accepted draft tokens plus the bonus token).

    * ``decode_rounds``: target forwards after prefill.
    * ``generated_tokens``: tokens returned to the client (after stop trimming), first one included.
    * ``decode_tokens``: tokens the decode rounds produced (before stop trimming), i.e. without the
      prefill token.
    * ``mean_acceptance_length`` (tau): ``decode_tokens / decode_rounds``; ``None`` when there was
      no decode round (e.g. a 1-token request): undefined, never 0.
    * ``prefill_seconds``: prompt forward(s) up to the first token; ``decode_seconds``: from then on.
    * ``tokens_per_second``: decode speed ``decode_tokens / decode_seconds``; ``None`` when there
      was no decode round (the prefill token is never counted against decode time).
    * ``spec_policy``: ``auto`` when the speculation policy chose the request's trees round by round
      (``engine/batch/policy.py``), ``fixed`` when its mode and tree budget were used as given.
    * ``mean_tree_nodes``: draft nodes the request verified per decode round (root excluded);
      ``mean_round_nodes``: draft nodes of the whole batch per round it ran in (the policy's N plus
      the fixed-mode requests' nodes); ``None`` without rounds.
    * ``plain_rounds`` / ``chain_rounds`` / ``tree_rounds``: its rounds whose tree was the root alone,
      one path, or branched.
    """

    mode: str
    tree_budget: int | None
    block_size: int | None
    decode_rounds: int
    generated_tokens: int
    mean_acceptance_length: float | None
    prefill_seconds: float
    decode_seconds: float
    tokens_per_second: float | None
    decode_tokens: int = 0
    spec_policy: str | None = None
    mean_tree_nodes: float | None = None
    mean_round_nodes: float | None = None
    plain_rounds: int = 0
    chain_rounds: int = 0
    tree_rounds: int = 0

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return asdict(self)
