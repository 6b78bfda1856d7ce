"""Log-probabilities of emitted tokens (the `logprobs` of the OpenAI API).

A token's logprob is ``log_softmax`` of the target's *processed* logits at the position that
emitted it: after the grammar mask, ``logit_bias`` and the penalties, before temperature and
top-p (so the numbers are the same at every temperature, greedy included, and a token the grammar
forbids has probability 0). ``top`` lists the ``n`` most probable tokens of that distribution,
most probable first; -inf (a forbidden token) is reported as LOGPROB_FLOOR, as OpenAI reports
its lowest values. The rows come from the verify forward of the round that emitted the tokens,
so the values are those of plain decoding up to fp32 rounding in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from ddtree_server.engine.params import MAX_TOP_LOGPROBS  # noqa: F401 (re-exported)

LOGPROB_FLOOR = -9999.0   # reported instead of -inf (JSON has no infinity)


@dataclass
class TokenLogprob:
    """One emitted token: its id, its logprob and the ``top`` (id, logprob) alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def _finite(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_logprobs(rows: Tensor, tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of ``tokens[i]`` under row i of ``rows [k, V]`` (processed logits) with the
    ``top_n`` (0..MAX_TOP_LOGPROBS) best alternatives; one device-to-host copy."""
    k = len(tokens)
    lp = torch.log_softmax(rows[:k].float(), dim=-1)
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    if top_n > 0:
        vals, top_ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        packed = torch.cat((chosen, vals, top_ids.to(lp.dtype)), dim=1).cpu().tolist()
    else:
        packed = chosen.cpu().tolist()
    n = (len(packed[0]) - 1) // 2 if top_n > 0 else 0
    out = []
    for tok, row in zip(tokens, packed):
        top = [(int(row[1 + n + j]), _finite(row[1 + j])) for j in range(n)]
        out.append(TokenLogprob(int(tok), _finite(row[0]), top))
    return out
