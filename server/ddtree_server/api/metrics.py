"""Prometheus metrics of the API server (prometheus-client, one registry per app).

Names (all prefixed `ddtree_`):

* `requests_total{endpoint,status}` — HTTP requests answered, by route and status code;
* `prompt_tokens_total`, `generated_tokens_total` — tokens in and out (tokens);
* `acceptance_length` — histogram of mean accepted tokens per target forward, per request (tokens);
  only requests with at least one decode round (forward after prefill) are observed;
* `decode_tokens_per_second` — histogram of per-request decode speed (tokens/s), same rule;
* `decode_rounds_total`, `decode_tokens_total`, `decode_seconds_total` — monotonic sums over
  finished requests of target forwards after prefill, the tokens they produced and their time:
  mean tau = decode_tokens_total / decode_rounds_total, decode tokens/s =
  decode_tokens_total / decode_seconds_total (rates over any window: ratio of `rate()`s);
* `verified_draft_nodes_total`, `accepted_draft_tokens_total` — over finished requests, the draft
  nodes their rounds verified and the draft tokens accepted (decode tokens minus bonus tokens):
  acceptance per verified node = accepted / verified;
* `time_to_first_token_seconds` — queue wait + prefill + first round, per request (s);
* `queue_depth` / `running_requests` — requests waiting for / running on the worker;
* `round_age_seconds` — how long the engine round in progress has run (0 when none runs) (s);
* `oldest_queued_age_seconds` — how long the oldest queued request has waited (0 when none) (s);
* `worker_stalled` — 1 while the round in progress is older than `--stall-seconds`, else 0;
* `requests_cancelled_total` — generations stopped because the client went away or the drain deadline passed;
* `batch_size` — requests in the last engine step (its decode round's batch plus the prompts it prefilled);
* `step_seconds{kind}` — histogram of engine step times, kind prefill (prompt chunks only) | decode
  (a decode round only) | mixed (prompt chunks, then a decode round) (s);
* `step_tokens` — histogram of tokens one step with a decode round produced over all its requests (tokens);
* `prefill_tokens_total` — prompt tokens run by prefill chunks (tokens);
* `prefilling_requests` — running requests whose prompt is not yet wholly prefilled;
* `slot_bytes` — memory of one request slot: the target's KV (and GDN state) plus the drafter's
  context K/V at max_model_len, allocated once per slot (bytes);
* `round_scratch_bytes` — memory allocated once for all slots: a hybrid target's round verify
  scratch (`chunk` method; not part of `slot_bytes`) (bytes);
* `slots{state}` — request slots used | free (`--max-running` in all);
* `kv_rows_used` / `kv_rows_capacity` — cached tokens of the running requests / slots x max_model_len
  (the paged layout: pages x 16) (tokens);
* `kv_pages{state}` — the paged layout's KV pages of 16 tokens used | free (0 in the slot layout);
  `kv_page_bytes` — memory of one page (bytes); `preemptions_total` — requests preempted
  (their pages freed, recomputed on resume) because pages ran out;
* `round_draft_nodes` — histogram of the draft nodes one decode round verified over all its
  requests (N: the speculation policy's choice plus fixed-mode requests' nodes; roots excluded);
  `last_round_draft_nodes` — the same for the last round (gauge);
* `request_rounds_total{kind}` — request-rounds by the shape of the request's tree, kind
  plain (the root alone) | chain (one path) | tree (branched);
* `server_state` — loading | warming | ready | draining | stopped | failed.
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Enum, Gauge,
                               Histogram, generate_latest)

STATES = ["loading", "warming", "ready", "draining", "stopped", "failed"]
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
             "/openapi.json")


class Metrics:
    """The server's metric objects, registered on a private `CollectorRegistry`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "HTTP requests answered.", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generated_tokens = Counter("ddtree_generated_tokens", "Tokens generated.", registry=r)
        self.cancelled = Counter("ddtree_requests_cancelled",
                                 "Generations cancelled by a client disconnect or the drain deadline.", registry=r)
        self.decode_rounds = Counter("ddtree_decode_rounds", "Target forwards after prefill.", registry=r)
        self.decode_tokens = Counter("ddtree_decode_tokens", "Tokens produced by decode rounds (after prefill).",
                                     registry=r)
        self.decode_seconds = Counter("ddtree_decode_seconds", "Time spent in decode rounds (s).", registry=r)
        self.draft_nodes = Counter("ddtree_verified_draft_nodes", "Draft nodes verified for finished requests.",
                                   registry=r)
        self.accepted_drafts = Counter("ddtree_accepted_draft_tokens",
                                       "Draft tokens accepted for finished requests (bonus tokens excluded).", registry=r)
        self.acceptance_length = Histogram(
            "ddtree_acceptance_length", "Mean accepted tokens per target forward (tau), per request.",
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16), registry=r)
        self.tokens_per_second = Histogram(
            "ddtree_decode_tokens_per_second", "Decode speed per request (tokens/s).",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 400, 800, 1600), registry=r)
        self.ttft = Histogram(
            "ddtree_time_to_first_token_seconds", "Queue wait + prefill + first round (s).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.queue_depth = Gauge("ddtree_queue_depth", "Requests waiting for the worker.", registry=r)
        self.running = Gauge("ddtree_running_requests", "Requests running on the worker.", registry=r)
        self.round_age = Gauge("ddtree_round_age_seconds",
                               "Age of the engine round in progress (0 when none runs) (s).", registry=r)
        self.oldest_queued_age = Gauge("ddtree_oldest_queued_age_seconds",
                                       "Wait of the oldest queued request (0 when none waits) (s).", registry=r)
        self.stalled = Gauge("ddtree_worker_stalled",
                             "1 while the round in progress is older than --stall-seconds, else 0.", registry=r)
        self.batch_size = Gauge("ddtree_batch_size", "Requests in the last engine step.", registry=r)
        self.step_seconds = Histogram(
            "ddtree_step_seconds", "Engine step time (s).", ["kind"],
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5), registry=r)
        self.step_tokens = Histogram(
            "ddtree_step_tokens", "Tokens produced by one decode step, all requests together.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.round_nodes = Histogram(
            "ddtree_round_draft_nodes", "Draft nodes verified by one decode round, all requests together (N).",
            buckets=(0, 1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048), registry=r)
        self.last_round_nodes = Gauge("ddtree_last_round_draft_nodes",
                                      "Draft nodes verified by the last decode round (N).", registry=r)
        self.request_rounds = Counter("ddtree_request_rounds", "Request-rounds by tree kind (plain | chain | tree).",
                                      ["kind"], registry=r)
        self.prefill_tokens = Counter("ddtree_prefill_tokens", "Prompt tokens run by prefill chunks.", registry=r)
        self.prefilling = Gauge("ddtree_prefilling_requests", "Running requests still prefilling their prompt.",
                                registry=r)
        self.slot_bytes = Gauge("ddtree_slot_bytes", "Memory of one request slot (target + drafter caches) (bytes).",
                                registry=r)
        self.scratch_bytes = Gauge("ddtree_round_scratch_bytes", "Memory allocated once for all slots: a hybrid "
                                   "target's round verify scratch (bytes).", registry=r)
        self.slots = Gauge("ddtree_slots", "Request slots by state (used | free).", ["state"], registry=r)
        self.kv_rows_used = Gauge("ddtree_kv_rows_used", "Cached tokens of the running requests (tokens).",
                                  registry=r)
        self.kv_rows_capacity = Gauge("ddtree_kv_rows_capacity", "Slots x max_model_len (tokens).", registry=r)
        self.kv_pages = Gauge("ddtree_kv_pages", "KV pages of 16 tokens by state (used | free; paged layout).",
                              ["state"], registry=r)
        self.page_bytes = Gauge("ddtree_kv_page_bytes", "Memory of one KV page (bytes; paged layout).", registry=r)
        self.preemptions = Counter("ddtree_preemptions", "Requests preempted by recompute because KV pages "
                                   "ran out (paged layout).", registry=r)
        self._preempted = 0
        self.graph_pool_bytes = Gauge("ddtree_cuda_graph_pool_bytes", "Device memory the batched CUDA graphs' pool "
                                      "took (bytes).", registry=r)
        self.eager_reserve_bytes = Gauge("ddtree_eager_reserve_bytes", "Working memory of the largest eager round, "
                                         "measured at start-up and kept free of graph captures (bytes).", registry=r)
        self.graphs_captured = Gauge("ddtree_cuda_graphs_captured", "Batched CUDA graphs captured (target and "
                                     "drafter).", registry=r)
        self.graph_declined = Gauge("ddtree_cuda_graph_declined_rounds", "Batched rounds run eagerly because memory "
                                    "was short for a new graph.", registry=r)
        self.state = Enum("ddtree_server_state", "Server lifecycle state.", states=STATES, registry=r)
        self.state.state("loading")

    def count_request(self, path: str, status: int) -> None:
        """Count one answered request; unknown paths are folded into `other` (bounded labels)."""
        endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_finished(self, *, prompt_tokens: int, stats: dict | None, cancelled: bool = False) -> None:
        """Record one finished generation from its `DecodeStats.to_dict()` (may be None)."""
        self.prompt_tokens.inc(prompt_tokens)
        if cancelled:
            self.cancelled.inc()
        if not stats:
            return
        self.generated_tokens.inc(stats.get("generated_tokens") or 0)
        rounds = stats.get("decode_rounds") or 0
        if rounds <= 0:   # prefill only: no decode speed or acceptance length to speak of
            return
        self.decode_rounds.inc(rounds)
        self.decode_tokens.inc(stats.get("decode_tokens") or 0)
        self.decode_seconds.inc(max(stats.get("decode_seconds") or 0.0, 0.0))
        if stats.get("mean_tree_nodes") is not None:
            self.draft_nodes.inc(round(stats["mean_tree_nodes"] * rounds))
            self.accepted_drafts.inc(max((stats.get("decode_tokens") or 0) - rounds, 0))
        tau = stats.get("mean_acceptance_length")
        if tau:
            self.acceptance_length.observe(tau)
        tps = stats.get("tokens_per_second")
        if tps:
            self.tokens_per_second.observe(tps)

    def observe_step(self, info) -> None:
        """Record one engine step (``engine.batch.StepInfo``: kind, batch, tokens, seconds)."""
        self.batch_size.set(info.batch)
        if info.kind in ("prefill", "decode", "mixed"):
            self.step_seconds.labels(kind=info.kind).observe(info.seconds)
        if info.kind in ("decode", "mixed"):
            self.step_tokens.observe(info.tokens)
            nodes = getattr(info, "nodes", 0) or 0
            self.round_nodes.observe(nodes)
            self.last_round_nodes.set(nodes)
            for kind, count in (getattr(info, "kinds", None) or {}).items():
                if count:
                    self.request_rounds.labels(kind=kind).inc(count)
        self.prefill_tokens.inc(getattr(info, "prefill_tokens", 0) or 0)

    def observe_memory(self, mem) -> None:
        """Set the slot gauges from ``engine.batch.SlotMemory`` (None: nothing loaded yet)."""
        if mem is None:
            return
        self.slot_bytes.set(mem.slot_bytes)
        self.scratch_bytes.set(getattr(mem, "scratch_bytes", 0))
        self.slots.labels(state="used").set(mem.used)
        self.slots.labels(state="free").set(mem.slots - mem.used)
        self.kv_rows_used.set(mem.kv_rows_used)
        self.kv_rows_capacity.set(mem.kv_rows_capacity)
        self.prefilling.set(mem.prefilling)
        self.graph_pool_bytes.set(getattr(mem, "graph_pool_bytes", 0))
        self.eager_reserve_bytes.set(getattr(mem, "eager_reserve_bytes", 0))
        self.graphs_captured.set(getattr(mem, "graphs_captured", 0))
        self.graph_declined.set(getattr(mem, "graph_declined_rounds", 0))
        self.kv_pages.labels(state="used").set(getattr(mem, "kv_pages_used", 0))
        self.kv_pages.labels(state="free").set(getattr(mem, "kv_pages_free", 0))
        self.page_bytes.set(getattr(mem, "page_bytes", 0))
        seen = getattr(mem, "preemptions", 0)
        if seen > self._preempted:
            self.preemptions.inc(seen - self._preempted)
            self._preempted = seen

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
