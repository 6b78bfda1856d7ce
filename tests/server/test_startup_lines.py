"""The start-up lines of ``load_engine`` (the server logs them and ``ddtctl`` shows them): the KV
layout taken and why, and a page count that the layout cannot use (the real SmolLM2 on the CPU)."""

from __future__ import annotations

import pytest
from ddtree_server.engine.factory import load_engine


@pytest.mark.slow
def test_start_up_lines_name_the_layout_and_an_ignored_page_count():
    lines = "\n".join(load_engine(kv_pages=50, max_model_len=256, use_default_drafter=False).messages)
    assert "batching (slot KV layout, chosen by --kv-layout auto)" in lines
    assert "--kv-pages 50 ignored: the slot KV layout has no pages" in lines
    paged = "\n".join(load_engine(kv_layout="paged", kv_pages=50, max_model_len=256,
                                  use_default_drafter=False).messages)
    assert "batching (paged KV layout)" in paged and "ignored" not in paged and "49 KV pages" in paged
