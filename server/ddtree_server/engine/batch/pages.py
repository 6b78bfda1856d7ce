"""KV pages: the free list and per-request page tables of a paged cache (bookkeeping only).

A paged cache stores K/V as ``[num_pages, kv_heads, page_size, head_dim]`` per layer; request r's
row j lives in page ``table[r][j // page_size]`` at row ``j % page_size`` (the attention kernel
reads through the table: ``kernels/attention_batch.py`` with ``pages``). Page 0 is the dummy that
padding rows of fixed-shape rounds may write to: it is never handed to a request, and table rows
are padded with it.

Memory is reserved ahead of a round: before a round that writes n rows after s committed ones, a
request holds pages for ``s + n`` rows (``reserve``); rows of a tree that were not accepted stay
in the request's pages for its next round. When the free pages cannot cover every running
request's look-ahead, ``plan_round`` shrinks what the newest requests ask for first (tree ->
chain -> plain, as vLLM and nano-vllm shrink their look-ahead) and only then preempts the newest
requests (their pages freed; they are recomputed from prompt + generated tokens on resume).

This module does no I/O and imports no torch at module level (``table`` builds the device tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_SIZE = 16


class PageError(RuntimeError):
    """A broken invariant of the page bookkeeping (a bug, never a user error)."""


class PagePool:
    """``num_pages`` pages of ``page_size`` rows (page 0: the dummy). ``check``: verify the
    invariants after every change (debug mode; ``verify`` runs them on demand)."""

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE, check: bool = False):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need at least 2 pages (one is the dummy) of >= 1 row, got {num_pages} x {page_size}")
        self.num_pages, self.page_size, self.check = num_pages, page_size, check
        self._free = list(range(num_pages - 1, 0, -1))   # a stack: the lowest page ids go first
        self.tables: dict[object, list[int]] = {}
        self.changed: set = set()   # requests whose table changed since ``take_changed``

    def pages_for(self, rows: int) -> int:
        """Pages that hold ``rows`` rows."""
        return -(-max(rows, 0) // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        """Pages held by requests (the dummy not counted)."""
        return self.num_pages - 1 - len(self._free)

    def held(self, rid) -> int:
        """Pages ``rid`` holds (0 for an unknown request)."""
        return len(self.tables.get(rid, ()))

    def growth(self, rid, rows: int) -> int:
        """New pages ``rid`` needs to hold ``rows`` rows."""
        return max(0, self.pages_for(rows) - self.held(rid))

    def fits(self, rid, rows: int) -> bool:
        """Whether the free pages cover ``rid`` growing to ``rows`` rows."""
        return self.growth(rid, rows) <= len(self._free)

    def reserve(self, rid, rows: int) -> bool:
        """Grow ``rid``'s table (a new request gets one) to hold ``rows`` rows: all or nothing
        (False, and nothing taken, when the free pages do not cover it)."""
        need = self.growth(rid, rows)
        if need > len(self._free):
            return False
        if need or rid not in self.tables:
            self.changed.add(rid)
        table = self.tables.setdefault(rid, [])
        for _ in range(need):
            table.append(self._free.pop())
        self._verify()
        return True

    def release(self, rid) -> int:
        """Return every page of ``rid`` to the free list (finished, cancelled or preempted); the
        number of pages freed (0 for an unknown request)."""
        table = self.tables.pop(rid, [])
        self.changed.add(rid)
        self._free.extend(reversed(table))
        self._verify()
        return len(table)

    def take_changed(self) -> list:
        """The requests whose table changed (grown, created or released) since the last call."""
        out, self.changed = list(self.changed), set()
        return out

    def table(self, rids: list, width: int | None = None, device=None):
        """int32 tensor ``[len(rids), width]`` of the requests' page tables, padded with the dummy
        page 0 (``width``: the widest table by default)."""
        import torch

        width = width if width is not None else max((self.held(r) for r in rids), default=0)
        out = torch.zeros((len(rids), max(width, 1)), dtype=torch.int32)
        for i, rid in enumerate(rids):
            pages = self.tables.get(rid, [])
            if len(pages) > width:
                raise ValueError(f"request {rid!r} holds {len(pages)} pages, more than the width {width}")
            out[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return out if device is None else out.to(device)

    def verify(self) -> None:
        """Every page is either free or in exactly one table, the dummy in neither; PageError
        naming the first broken rule."""
        seen = [p for table in self.tables.values() for p in table] + self._free
        for broken, what in ((0 in seen, "the dummy page 0 was handed out or freed"),
                             (len(seen) != len(set(seen)), "a page is held twice (or held and free)"),
                             (sorted(seen) != list(range(1, self.num_pages)), "a page was lost or invented")):
            if broken:
                raise PageError(what)

    def _verify(self) -> None:
        if self.check:
            self.verify()


@dataclass
class Ask:
    """A running request's look-ahead for the next round: ``s`` committed rows and the rows its
    tree, its chain and plain decoding would write (plain: 1). ``order``: admission order (the
    newest is shrunk and preempted first). ``draft``: the rows the drafter's block writes after
    ``s`` (the block size; 0 without drafting), reserved with any grant above plain (a plain
    round does not draft: ``StepRunner._drafting``)."""

    rid: object
    s: int
    tree: int
    chain: int
    order: int
    plain: int = 1
    draft: int = 0

    def rows(self, grant: int) -> int:
        """Rows to reserve after ``s`` for ``grant`` rows of the tree (the draft block's at least)."""
        return max(grant, self.draft) if grant > self.plain else grant


def plan_round(pool: PagePool, asks: list[Ask]) -> tuple[dict, list]:
    """What each running request may write next round so that every look-ahead fits the free
    pages: ``({rid: rows}, preempted rids)``. Everyone keeps its tree while the pages last; else
    the newest requests drop to their chain, then to plain decoding, one request at a time, and
    only when even plain decoding for all does not fit are the newest requests preempted (their
    pages then count as free for the others). The oldest request is never preempted: the pool is
    sized to hold one request at the model's full length. Nothing is reserved here: the caller
    releases the preempted requests and reserves the granted rows."""
    grant = {a.rid: a.tree for a in asks}
    by_age = sorted(asks, key=lambda a: a.order, reverse=True)   # newest first
    free = pool.free_pages

    def need() -> int:
        return sum(pool.growth(a.rid, a.s + a.rows(grant[a.rid])) for a in asks if a.rid in grant)

    for level in ("chain", "plain"):
        for a in by_age:
            if need() <= free:
                return grant, []
            grant[a.rid] = min(grant[a.rid], getattr(a, level))
    preempted = []
    for a in by_age:
        if need() <= free or len(grant) == 1:
            break
        del grant[a.rid]
        free += pool.held(a.rid)
        preempted.append(a.rid)
    return grant, preempted
