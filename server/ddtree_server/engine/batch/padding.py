"""The padded layout of batched-round CUDA graphs, as pure arithmetic: the buckets of the batch, of
a block's rows and of a round's rows, and the padded shape of a round's blocks (``graphs.py``
captures one graph per shape; ``hybrid_rounds.round_rows`` sizes the round scratch for it)."""

from __future__ import annotations

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 17, 24, 33, 48, 65, 80)
# past 1,024 rows every 256 (a round there is compute-bound: padding rows cost their GEMM time);
# 2,560: 32 trees of 80 nodes (DDTree budget 64 at batch 32 is 2,080 rows)
# a lone tree of 17 / 33 / 65 / 80 rows (DDTree budgets 16 / 32 / 64, the hybrid cap) is a round of its
# own rows: no padding block beside it (whose attention programs and GEMM rows a batch-1 round would pay)
TOTAL_BUCKETS = (1, 2, 4, 8, 12, 16, 17, 24, 32, 33, 48, 64, 65, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280,
                 1536, 1792, 2048, 2304, 2560)
MAX_ROWS = TOTAL_BUCKETS[-1]   # rows of one graph (its logits are [N_pad, vocab])


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def padded_shape(sizes: list[int]) -> tuple[int, int, int] | None:
    """(B, N_pad, r) for blocks of these sizes: the smallest buckets whose padding rows
    ``N_pad - N`` fill the ``B - b`` padding blocks with 1 .. r rows each; None past the buckets."""
    b, n = len(sizes), sum(sizes)
    r = bucket(max(sizes), ROW_BUCKETS)
    b_pad, n_pad = bucket(b, BATCH_BUCKETS), bucket(n, TOTAL_BUCKETS)
    while b_pad is not None and n_pad is not None and r is not None:
        k, extra = b_pad - b, n_pad - n
        if k == 0 and extra > 0:
            b_pad = bucket(b + 1, BATCH_BUCKETS)
        elif extra < k:
            n_pad = bucket(n + k, TOTAL_BUCKETS)
        elif extra > k * r:
            b_pad = bucket(b + -(-extra // r), BATCH_BUCKETS)
        else:
            return b_pad, n_pad, r
    return None
