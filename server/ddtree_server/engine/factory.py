"""Build an Engine from paths (CLI, API server, bench): target + tokenizer + optional drafter.

Defaults (docs/architecture.md, config.py): no target and no GGUF -> the embedded SmolLM2 GGUF;
no drafter -> the shipped drafter folder when present and compatible, else none.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddtree_server.engine.defaults import sampling_defaults
from ddtree_server.engine.engine import Engine
from ddtree_server.models import default
from ddtree_server.models.common import resolve_dtype
from ddtree_server.models.load import load_target

log = logging.getLogger(__name__)


def load_engine(*, target: str | Path | None = None, gguf: str | Path | None = None,
                drafter: str | Path | None = None, use_default_drafter: bool = True,
                target_layer_ids: list[int] | None = None, device: str = "cpu", dtype: str = "fp32",
                mode: str | None = None, tree_budget: int | None = None,
                max_model_len: int | None = None, model_id: str | None = None,
                max_running: int | None = None, kv_memory_fraction: float | None = None,
                prefill_chunk: int | None = None, spec_policy: str = "fixed", spec_gate: bool = False,
                round_rows: int | None = None, kv_layout: str = "auto", kv_pages: int | None = None) -> Engine:
    """Load models and return a ready Engine; ``engine.messages`` holds the start-up lines.

    Raises:
        DefaultModelError: the default GGUF is needed but missing/corrupt.
        TargetLoadError / DrafterLoadError / DrafterConfigError: bad model files (an explicit
            drafter only; an incompatible DEFAULT drafter is skipped with a message).
        ValueError: bad dtype or unavailable mode.
    """
    messages: list[str] = []
    sha = None
    if target is None and gguf is None:
        gguf = default.default_gguf_path(verify=True)
        sha = default.DEFAULT_GGUF_SHA256
        model_id = model_id or default.DEFAULT_MODEL_ID
    loaded = load_target(target, gguf=gguf, gguf_sha256=sha, device=device, dtype=dtype)
    messages.append(loaded.message)
    if model_id is None:
        model_id = Path(target).name if target is not None else Path(gguf).stem
    draft_model = None
    explicit = drafter is not None
    if drafter is None and use_default_drafter and default.default_drafter_available():
        drafter = default.default_drafter_dir()
    if drafter is not None and not loaded.tree_mode_available:
        messages.append(f"drafter {drafter} ignored: the target cannot verify draft trees")
        drafter = None
    if drafter is not None:
        from ddtree_server.models.drafter.load import load_drafter

        cfg = loaded.config
        try:
            draft_model = load_drafter(
                drafter, embed_tokens=loaded.model.embed_tokens, lm_head=loaded.model.lm_head,
                target_hidden_size=cfg.hidden_size, target_num_layers=cfg.num_hidden_layers,
                target_vocab_size=cfg.vocab_size, target_layer_ids=target_layer_ids,
                device=device, dtype=resolve_dtype(dtype))
            messages.append(f"drafter {drafter}: block size {draft_model.config.block_size}, "
                            f"target layers {list(draft_model.config.target_layer_ids)}")
        except Exception as exc:  # noqa: BLE001 - the default drafter is optional
            if explicit:
                raise
            messages.append(f"default drafter skipped: {exc}")
            draft_model = None
    engine = Engine(loaded.model, loaded.tokenizer, draft_model, model_id=model_id,
                    max_model_len=max_model_len, tree_mode_available=loaded.tree_mode_available,
                    default_mode=mode, tree_budget=tree_budget, eos_token_ids=loaded.eos_token_ids,
                    max_running=max_running, kv_memory_fraction=kv_memory_fraction, prefill_chunk=prefill_chunk,
                    spec_policy=spec_policy, spec_gate=spec_gate, round_rows=round_rows, kv_layout=kv_layout,
                    kv_pages=kv_pages)
    chunk = engine.batch.prefill_chunk
    mem = engine.batch.memory
    if kv_pages and engine.kv_layout != "paged":
        messages.append(f"--kv-pages {kv_pages} ignored: the {engine.kv_layout} KV layout has no pages")
    chosen = f"{engine.kv_layout} KV layout" + (", chosen by --kv-layout auto" if kv_layout == "auto" else "")
    messages.append(f"batching ({chosen}): up to {engine.max_concurrency} running requests per step, "
                    + (f"{mem.kv_pages_free} KV pages of 16 tokens ({mem.page_bytes / 2**20:.2f} MiB each, "
                       f"{mem.kv_rows_capacity} tokens), {engine.batch.slot_bytes / 2**20:.1f} MiB per slot outside the pages"
                       if mem.page_bytes else f"{engine.batch.slot_bytes / 2**20:.1f} MiB per slot")
                    + (f" + {engine.batch.scratch_bytes / 2**20:.1f} MiB round scratch" if engine.batch.scratch_bytes else "")
                    + "; prefill "
                    + (f"chunks of {chunk} tokens per step" if chunk else "of whole prompts"))
    messages.append(f"default mode {engine.default_mode}" + (
        f", tree budget {engine.tree_budget}" if engine.default_mode == "ddtree" else "")
        + f", spec policy {engine.spec_policy}, spec gate {'on' if engine.batch.gate is not None else 'off'}")
    if engine.spec_policy == "auto":
        prof = engine.batch.runner.policy.profile
        messages.append("spec policy profile: target forward " + ", ".join(
            f"{r} rows {1e3 * t:.2f} ms" for r, t in zip(prof.rows, prof.seconds))
            + f"; +{1e3 * prof.per_request:.3f} ms per request; drafter {1e3 * prof.draft:.2f} ms")
    engine.sampling_defaults = sampling_defaults(loaded.folder, embedded=sha is not None)
    if engine.sampling_defaults:
        messages.append("sampling defaults for requests that omit them: " + ", ".join(
            f"{k} {v}" for k, v in engine.sampling_defaults.items()))
    engine.messages = messages
    for line in messages:
        log.info("%s", line)
    return engine


def engine_from_config(cfg) -> Engine:
    """Engine for a ``ddtree_server.config.ServerConfig``."""
    return load_engine(target=cfg.target, gguf=cfg.gguf, drafter=cfg.drafter,
                       target_layer_ids=cfg.target_layer_ids, device=cfg.device, dtype=cfg.dtype,
                       mode=cfg.mode, tree_budget=cfg.tree_budget, max_model_len=cfg.max_model_len,
                       model_id=cfg.served_model_name, max_running=cfg.max_running or cfg.max_concurrency,
                       kv_memory_fraction=cfg.kv_memory_fraction, prefill_chunk=cfg.prefill_chunk,
                       spec_policy=cfg.spec_policy, spec_gate=cfg.spec_gate, round_rows=cfg.round_rows,
                       kv_layout=cfg.kv_layout, kv_pages=cfg.kv_pages)
