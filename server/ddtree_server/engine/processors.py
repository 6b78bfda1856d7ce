"""Per-request logits processing that stays exact under speculation (docs/architecture.md,
"Request processor contract"; docs/constrained.md).

A ``RequestProcessor`` applies, in vLLM's order, the grammar mask (constrained decoding), then
``logit_bias``, then ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``
to the target logits of a verified tree. What a row may depend on is the tokens before its
position: the committed ones (prompt + emitted, kept here) and the tree tokens on the node's root
path. ``process`` gives each node the counts and the grammar state of ITS path, so the target's
choice at every node is the one plain decoding makes after that prefix, and the accepted output
equals processed plain decoding token for token (``ar`` is the one-node tree). ``commit`` then
advances the committed state by the emitted tokens. A request without any of these has
``active`` False and the decode loops skip the processor entirely.

Penalties follow vLLM (vllm/model_executor/layers/utils.py ``apply_penalties``): repetition
divides positive logits and multiplies negative ones by the penalty for every token seen in the
prompt or the output; frequency subtracts penalty x output count; presence subtracts the penalty
once for every token seen in the output. Logprobs (engine/logprobs.py) are taken from the
processed rows of the emitted tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ddtree_server.engine.logprobs import TokenLogprob, token_logprobs


class RequestProcessor:
    """Logits processing + logprob bookkeeping of one request (any decode loop may call it).

    Args:
        params: the request's ``SamplingParams`` (grammar, logit_bias, penalties, logprobs).
        prompt_ids: the prompt (repetition_penalty counts its tokens).
        vocab_size: logits columns; device: where the logits live.
    Attributes: ``active`` (logits are changed: call ``process``), ``wants_logprobs``.
    """

    def __init__(self, params, prompt_ids: Sequence[int], vocab_size: int, device):
        self.vocab_size, self.device = int(vocab_size), torch.device(device)
        self.top_n = params.logprobs
        self.wants_logprobs = params.logprobs is not None
        self.rep = float(params.repetition_penalty)
        self.freq, self.pres = float(params.frequency_penalty), float(params.presence_penalty)
        self.penalised = self.rep != 1.0 or self.freq != 0.0 or self.pres != 0.0
        self.bias: Tensor | None = None
        if params.logit_bias:
            ids = [int(t) for t in params.logit_bias]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            self.bias = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            self.bias[torch.tensor(ids, device=self.device)] = torch.tensor(
                [float(v) for v in params.logit_bias.values()], device=self.device)
        self.matcher = None
        if params.grammar is not None:
            from ddtree_server.constrained.matcher import TreeMatcher

            self.matcher = TreeMatcher(params.grammar, self.vocab_size)
        self.active = self.matcher is not None or self.bias is not None or self.penalised
        self.prompt_set = set(int(t) for t in prompt_ids) if self.rep != 1.0 else set()
        self.counts: Counter[int] = Counter()   # output token -> times emitted
        self._logprobs: list[TokenLogprob] = []

    # ---- the per-round interface ----------------------------------------------------------------
    def process(self, logits: Tensor, parents: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """Processed copy (fp32) of ``logits [n, V]``: row i conditioned on the committed tokens
        plus ``tokens`` on node i's root path (node 0 = root, already committed, ``parents[0] = -1``,
        ``parents[i] < i``). The committed state is not changed. Returns ``logits`` itself when
        the processor is not active."""
        if not self.active:
            return logits
        out = logits.float().clone()
        if self.matcher is not None:
            self.matcher.apply(out, self.matcher.masks(parents, tokens))
        if self.bias is not None:
            out += self.bias
        if self.penalised:
            self._penalise(out, parents, tokens)
        return out

    def commit(self, tokens: Sequence[int], rows: Tensor | None = None) -> None:
        """The round emitted ``tokens``; ``rows [len(tokens), V]`` are the processed logits that
        chose them (needed only when logprobs are requested)."""
        if self.wants_logprobs and rows is not None:
            self._logprobs.extend(token_logprobs(rows, tokens, self.top_n))
        if self.matcher is not None:
            self.matcher.commit(tokens)
        if self.penalised:
            self.counts.update(int(t) for t in tokens)

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """Logprobs of the tokens committed since the last call (None when not requested)."""
        if not self.wants_logprobs:
            return None
        out, self._logprobs = self._logprobs, []
        return out

    # ---- penalties ------------------------------------------------------------------------------
    def _penalise(self, out: Tensor, parents: Sequence[int], tokens: Sequence[int]) -> None:
        """Apply the penalties to every row with that row's own counts (committed + its path)."""
        n = len(parents)
        path_tokens = [int(t) for t in tokens[1:n]]
        cols = sorted(self.prompt_set.union(self.counts.keys(), path_tokens))
        if not cols:
            return
        index = {t: j for j, t in enumerate(cols)}
        counts = np.zeros((n, len(cols)), dtype=np.float32)
        base = np.zeros(len(cols), dtype=np.float32)
        for t, c in self.counts.items():
            base[index[t]] = c
        counts[0] = base
        for i in range(1, n):   # parents precede children: row i = its parent's row + its token
            counts[i] = counts[parents[i]]
            counts[i, index[int(tokens[i])]] += 1.0
        cnt = torch.from_numpy(counts).to(self.device)
        col_t = torch.tensor(cols, dtype=torch.long, device=self.device)
        x = out.index_select(1, col_t)
        seen = cnt > 0
        if self.rep != 1.0:
            in_prompt = torch.tensor([t in self.prompt_set for t in cols], device=self.device)
            hit = seen | in_prompt[None, :]
            x = torch.where(hit, torch.where(x > 0, x / self.rep, x * self.rep), x)
        if self.freq != 0.0:
            x = x - self.freq * cnt
        if self.pres != 0.0:
            x = x - self.pres * seen.float()
        out.index_copy_(1, col_t, x)
