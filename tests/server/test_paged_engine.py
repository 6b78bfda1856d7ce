"""The paged KV layout in the batch engine (fp32, CPU; dense and hybrid targets): the same tokens
as the slot layout, alone, in any batch and as plain decoding, over many rounds, page reuse and
preemptions by recompute; every page free at the end. A hybrid's attention K/V is in pages, its
GDN states per slot (engine/batch/paged_hybrid.py), its prompt chunks batched through the pages.

The target's K/V lives in pages of 16 rows (engine/batch/paged.py); admission and each round's
look-ahead reserve pages (engine/batch/admission.py), and with few pages the newest requests are
shrunk to chains and plain rounds, then preempted and recomputed from prompt + emitted tokens.
Freed pages are filled with NaN and the page bookkeeping is verified after every change (the
debug mode), so a request reading a page it does not hold, or a lost page, fails the test. The
drafter is the oracle TEST DOUBLE of test_batch_engine.py (wrong at every 4th position: trees
are compacted through the page tables) and the real DFlashDrafter with random weights."""

from __future__ import annotations

import pytest
import torch
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.batch_fixtures import (LAYERS, MAX_LEN, check_alone_batched_ar, oracle_drafter, random_specs,
                                         real_drafter, run_together)
from tests.server.tiny import EOS, ByteTokenizer

pytest_plugins = ["tests.server.tiny_fixtures"]

LEAST = -(-(MAX_LEN + 1) // PAGE_SIZE) + 1   # one request at the model's maximum and the dummy page


def paged(target, drafter, pages: int, running: int = 8) -> Engine:
    return Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                  max_running=running, poison_freed_slots=True, kv_layout="paged", kv_pages=pages)


def all_free(engine: Engine) -> None:
    pages = engine.batch.runner.caches.pages
    pages.verify()
    assert pages.tables == {} and pages.free_pages == pages.num_pages - 1
    assert engine.batch.memory.kv_pages_used == 0


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("pages", [0, LEAST])
def test_32_random_requests_paged_equal_alone_and_ar(request, kind, pages):
    """Random arrivals, modes, stops, seeds and cancellations; ``0``: pages for every slot at the
    maximum (no shortage), ``LEAST``: so few that the rounds' trees shrink to chains and plain rounds."""
    target = request.getfixturevalue(kind)
    target.capture_layers = LAYERS
    specs = random_specs(seed=23 if kind == "dense" else 5)   # seeds whose arrivals shrink rounds on LEAST pages
    drafter, ar = oracle_drafter(target, specs)
    engine = paged(target, drafter, pages)
    check_alone_batched_ar(engine, specs, ar)
    all_free(engine)
    if pages:
        assert engine.batch.admission.shrunk > 0
    target.capture_layers = []


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_preempted_requests_resume_with_the_same_tokens(request, kind, caplog):
    """Six long generations (greedy and seeded sampling, every mode) on pages for about two:
    requests are preempted several times each and resumed by recompute (a hybrid's GDN state
    from the prompt and its tokens in chunks); every request's tokens are those it gets alone on
    the slot layout (and greedy ones plain decoding's)."""
    dense = request.getfixturevalue(kind)
    drafter = real_drafter(dense, window=12 if kind == "hybrid" else None)   # hybrid: the rings too
    slot = Engine(dense, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    engine = paged(dense, drafter, LEAST + 4, running=6)
    prompts = [list(f"request {i}: the cat sat on".encode()) for i in range(6)]
    modes = ["ddtree", "ar", "dflash", "ddtree", "ddtree", "ar"]
    seeds = [None, None, None, 7, None, 3]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.0 if seeds[i] is None else 0.8,
                              seed=seeds[i])

    order = iter(range(6))
    with caplog.at_level("INFO", logger="ddtree_server.engine.batch.engine"):
        got, sizes = run_together(engine, list(zip(prompts, modes)), lambda: params(next(order)))
    assert engine.batch.preemptions >= 6 and max(sizes) > 1
    said = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert len(said) == engine.batch.preemptions and "tokens to recompute" in said[0]   # each one logged
    all_free(engine)
    for i, (ids, mode) in enumerate(zip(prompts, modes)):
        alone = [t for ev in slot.generate(ids, params(i), mode=mode) for t in ev.token_ids]
        assert got[i] == alone, i
        if seeds[i] is None:
            ar = [t for ev in slot.generate(ids, params(i), mode="ar") for t in ev.token_ids]
            assert alone == ar, i
    dense.capture_layers = []


def test_admission_waits_for_pages_and_memory_shows_them(dense):
    """A request whose prompt's pages are not free waits in the queue (FCFS) while slots are
    free; /metrics' snapshot shows the pages used and free."""
    engine = paged(dense, None, LEAST + 2, running=4)
    long = list(range(3, 3 + 150))   # 10 pages of prompt
    reqs = [engine.make_request(long, SamplingParams(max_tokens=30, ignore_eos=True), rid=str(i)) for i in range(2)]
    for r in reqs:
        engine.batch.add(r)
    engine.batch.step()
    mem = engine.batch.memory
    assert engine.batch.running == 1 and len(engine.batch.scheduler.waiting) == 1
    assert mem.kv_pages_used == 10 and mem.kv_pages_free == LEAST + 1 - 10 and mem.page_bytes > 0
    while engine.batch.busy:
        engine.batch.step()
    assert all(len(r.checker.token_ids) == 30 for r in reqs)
    all_free(engine)


def test_paged_layout_refuses_too_few_pages_and_unknown_layouts(dense):
    for few in (LEAST - 1, 1):   # the number needed, even for fewer than the pool's minimum of 2
        with pytest.raises(ValueError, match=f"cannot hold one request of {MAX_LEN + 1} rows: at least {LEAST} are needed"):
            paged(dense, None, few)
    with pytest.raises(ValueError, match="unknown KV layout"):
        Engine(dense, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, kv_layout="pages")
    assert torch.get_num_threads() == 1


def test_auto_layout_is_the_slot_one_off_cuda(dense, hybrid):
    """``auto`` (the default) takes pages only on CUDA, where the slots would not hold the batch
    (test_paged_gpu.py); here slots, and an explicit ``paged`` is kept."""
    for target in (dense, hybrid):
        assert Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN).kv_layout == "slot"
        eng = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, kv_layout="paged")
        assert eng.kv_layout == "paged" and eng.batch.runner.paged


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_paged_rounds_through_the_padded_graph_layout(request, kind, monkeypatch):
    """The CUDA graphs' padded layout (engine/batch/graphs.py) over page tables, run eagerly on the
    CPU: padding blocks on a slot without pages write the dummy page only (a hybrid's: the GDN
    state of the scratch slot); every request's tokens are still its own alone and plain
    decoding's, with rounds shrunk for pages."""
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    dense = request.getfixturevalue(kind)
    dense.capture_layers = LAYERS
    specs = random_specs(seed=29, count=12)
    drafter, ar = oracle_drafter(dense, specs)
    engine = paged(dense, drafter, LEAST + 2, running=6)
    graphs = engine.batch.runner.graphs
    assert graphs is not None and graphs.scratch == 6
    check_alone_batched_ar(engine, specs, ar)
    assert graphs.rounds > 15
    if kind == "hybrid":
        assert graphs.pending_rounds > 5   # rounds of chains and trees through the pages
    all_free(engine)
    dense.capture_layers = []


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_draft_block_past_the_last_page_of_the_context(request, kind):
    """The drafter's block writes ``block_size`` rows after the committed length, up to
    ``block_size - 1`` past the model's maximum: the page tables are wide enough for them (rows
    past the reserved pages go to the dummy page), in every mode, up to the context's end."""
    dense = request.getfixturevalue(kind)
    drafter = real_drafter(dense)
    bs = drafter.config.block_size
    top = 16 * 7 - 1   # the last page's last row is the context's last: a block there runs past it
    eng = Engine(dense, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=top, max_running=2,
                 poison_freed_slots=True, kv_layout="paged")
    slot = Engine(dense, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=top, max_running=1)
    ids = list(b"the cat sat on the mat")
    for mode in ("ddtree", "dflash"):
        p = SamplingParams(max_tokens=top, ignore_eos=True)
        got = [t for ev in eng.generate(ids, p, mode=mode) for t in ev.token_ids]
        assert got == [t for ev in slot.generate(ids, p, mode=mode) for t in ev.token_ids]
        assert len(ids) + len(got) >= top - bs   # ran to the end of the context
    all_free(eng)


def test_hybrid_node_method_on_pages():
    """The hybrid's ``node`` GDN method (a verify scratch per slot, each request's commit through
    its cache's ``keep``) on pages: the same tokens as alone and as plain decoding."""
    from tests.server.hybrid_fixtures import tiny_hybrid

    target = tiny_hybrid("3gdn+attn", seed=21, method="node")
    engine = paged(target, real_drafter(target), LEAST + 6, running=4)
    assert engine.batch.runner.scratch is None and engine.batch.runner.caches.slot_bytes > 0
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    check_alone_batched_ar(engine, random_specs(seed=3, count=10), ar)
    all_free(engine)


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_memory_estimates_equal_what_the_paged_layout_builds(request, kind, window):
    """``memory.page_bytes`` (sizing before anything is built) is the built pool's bytes per page,
    the drafter's pages included; ``memory.paged_slot_bytes`` what a slot keeps outside the pages:
    a hybrid's GDN states (``state_bytes``) and the drafter's rings of its sliding-window layer
    (nothing for a dense target without rings). With a window the drafter's sliding layer leaves
    the pages for rings of the window and a block."""
    from ddtree_server.engine import memory

    target = request.getfixturevalue(kind)
    drafter = real_drafter(target, window=window)
    engine = paged(target, drafter, LEAST + 8, running=3)
    rows = memory._draft_rows(engine)
    assert memory.page_bytes(target, drafter, rows) == engine.batch.memory.page_bytes > 0
    assert memory.paged_slot_bytes(engine) == engine.batch.slot_bytes
    rings = engine.batch.slot_bytes - memory.state_bytes(engine)
    assert (engine.batch.slot_bytes > 0) == (kind == "hybrid" or window is not None)
    assert (rings > 0) == (window is not None)
    if window:   # one of 2 layers in a ring of 2 pages (12 + a block of 6 rows) per slot
        full = memory.page_bytes(target, real_drafter(target), rows)
        assert full - engine.batch.memory.page_bytes == rings // 2 == engine.batch.runner.dcaches.rk[:2].numel() * 4
