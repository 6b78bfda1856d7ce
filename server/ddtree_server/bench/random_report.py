"""Report of a random-shape stage run: bytes and implied bandwidth per stage, break-even
acceptance lengths, projected speedups; JSON, markdown and a bar plot.

Bytes a stage must read from device memory (the floor of its time at a given bandwidth):
* target forwards (`forward_1`, `plain_step`, `verify_*`, `device_round_*`): every target weight the forward
  touches (decoder layers, final norm, LM head; the embedding table only when tied, as the LM
  head) plus the K/V rows attention reads (`kv_len` rows, K and V, every layer);
* `draft`: the drafter's own weights, the target's LM head (block logits) and its K/V window;
* `round_*`: the target's bytes, plus the drafter's for speculative rounds;
* host-side stages (tree build, tree inputs, commit): none counted.
Break-even tau of a mode = its round time / the plain round (`round_ar`): the acceptance length
at which it only matches plain decoding. Projected speedup at tau = tau x plain round / round.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def model_bytes(engine) -> dict[str, int]:
    """Bytes of the target's read weights, the drafter's own weights, the LM head, and one K/V
    row (all layers, K and V) of the target and of the drafter."""
    target = getattr(engine.target, "model", engine.target)
    tied = getattr(target.config, "tie_word_embeddings", False)
    seen, total = set(), 0
    for name, p in target.named_parameters(remove_duplicate=True):
        if name.startswith("embed_tokens") and not tied:
            continue
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    lm = target.lm_head.weight
    out = {"target": total, "lm_head": lm.numel() * lm.element_size(), "drafter": 0, "drafter_kv_row": 0}
    elt = lm.element_size()
    cfg = target.config
    attn_layers = len(getattr(cfg, "attn_layers", None) or range(cfg.num_hidden_layers))  # hybrids: attention layers only
    head_dim = getattr(target, "head_dim", None) or cfg.head_dim
    out["target_kv_row"] = 2 * attn_layers * cfg.num_key_value_heads * head_dim * elt
    drafter = getattr(engine.drafter, "drafter", engine.drafter)
    if drafter is not None:
        out["drafter"] = sum(p.numel() * p.element_size() for p in drafter.parameters())
        dc = drafter.config
        out["drafter_kv_row"] = 2 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * elt
    return out


def stage_bytes(name: str, row: dict, sizes: dict[str, int]) -> tuple[int, int]:
    """(weight bytes, K/V bytes) a stage reads; (0, 0) for host-side stages."""
    kv = row.get("kv_len", 0)
    if name in ("forward_1", "plain_step") or name.startswith(("verify_", "device_round_")):
        return sizes["target"], kv * sizes["target_kv_row"]
    if name == "draft":
        return sizes["drafter"] + sizes["lm_head"], kv * sizes["drafter_kv_row"]
    if name == "round_ar":
        return sizes["target"], kv * sizes["target_kv_row"]
    if name.startswith("round_"):
        return sizes["target"] + sizes["drafter"] + sizes["lm_head"], kv * sizes["target_kv_row"]
    return 0, 0


def copy_bandwidth(device: torch.device, mib: int | None = None, iters: int = 10) -> dict:
    """Device-to-device copy of ``mib`` MiB (2048 on CUDA, 16 on CPU): median GB/s counting the
    bytes read plus the bytes written (10^9 bytes per GB)."""
    from ddtree_server.bench.timing import time_calls

    mib = mib or (2048 if device.type == "cuda" else 16)
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    r = time_calls(lambda: dst.copy_(src), iters, 2, device)
    return {"mib": mib, "ms": round(r["ms"], 4), "gbps_read_write": round(2 * n / (r["ms"] / 1000) / 1e9, 1)}


def env_meta(device: str, dtype: str) -> dict:
    """GPU (or CPU) name, torch / CUDA / triton / transformers / Python versions, commit, date."""
    import transformers

    from ddtree_server.bench.session import commit_id

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.startswith("cuda")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit_id(),
            "gpu": torch.cuda.get_device_name(torch.device(device)) if cuda else (platform.processor() or "cpu"),
            "device": device, "dtype": dtype, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version, "transformers": transformers.__version__, "python": platform.python_version()}


def derive(stages: dict[str, dict], sizes: dict[str, int], copy_gbps: float | None,
           tau: dict[str, float]) -> dict:
    """Adds weight_bytes, kv_bytes, gbps (and % of the copy bandwidth) to each stage row; returns
    {break_even_tau: {mode: x}, projected_speedup: {mode: {tau, speedup}}}."""
    for name, row in stages.items():
        w, kv = stage_bytes(name, row, sizes)
        row["weight_bytes"], row["kv_bytes"] = w, kv
        row["gbps"] = round((w + kv) / (row["ms"] / 1000) / 1e9, 1) if w and row["ms"] > 0 else None
        row["pct_of_copy"] = round(100 * row["gbps"] / copy_gbps, 1) if row["gbps"] and copy_gbps else None
    plain = stages.get("round_ar", {}).get("ms")
    even, projected = {}, {}
    for name, row in stages.items():
        if not name.startswith("round_") or name == "round_ar" or not plain:
            continue
        mode = name.removeprefix("round_").replace("ddtree_", "ddtree-")
        even[mode] = round(row["ms"] / plain, 3)
        t = tau.get(mode, tau.get(mode.split("-")[0]))
        if t is not None:
            projected[mode] = {"tau": t, "speedup": round(t * plain / row["ms"], 3)}
    return {"break_even_tau": even, "projected_speedup": projected}


def _fmt_bytes(b: int) -> str:
    return "-" if not b else f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def markdown(doc: dict) -> str:
    """The markdown report of one random-shape run."""
    m = doc["meta"]
    out = [f"# Stage times at the {m['shape']} shape (random weights)", ""]
    out += [f"- {k}: {v}" for k, v in m.items() if not isinstance(v, (dict, list))]
    cb = doc.get("copy_bandwidth") or {}
    if cb:
        out.append(f"- device copy bandwidth (read + write): {cb['gbps_read_write']} GB/s ({cb['mib']} MiB copy)")
    out += ["", "| stage | rows | kv_len | median ms | p10 | p90 | weights | K/V | GB/s | % of copy |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in doc["stages"].items():
        out.append(f"| {name} | {r['rows']} | {r.get('kv_len', '-')} | {r['ms']:.3f} | {r['p10']:.3f} | {r['p90']:.3f} "
                   f"| {_fmt_bytes(r.get('weight_bytes'))} | {_fmt_bytes(r.get('kv_bytes'))} "
                   f"| {r.get('gbps') or '-'} | {r.get('pct_of_copy') or '-'} |")
    d = doc.get("derived") or {}
    if d.get("break_even_tau"):
        out += ["", "| mode | break-even tau (round / plain round) | tau given | projected speedup |",
                "| --- | --- | --- | --- |"]
        for mode, x in d["break_even_tau"].items():
            p = d.get("projected_speedup", {}).get(mode, {})
            out.append(f"| {mode} | {x:.2f} | {p.get('tau', '-')} | {p.get('speedup', '-')} |")
    if doc.get("skipped"):
        out += ["", "Skipped (time budget): " + ", ".join(doc["skipped"])]
    out += ["", "Times: wall clock per call with the device synchronised before and after (median of "
            f"{m.get('iters')} calls). See bench/random_shape.py and bench/random_report.py for what each "
            "stage contains and which bytes are counted.", ""]
    return "\n".join(out)


def plot(doc: dict, path: Path) -> Path | None:
    """Horizontal bars of the stage medians; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(doc["stages"])
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(names) + 1.2))
    ax.barh(names, [doc["stages"][n]["ms"] for n in names], color="C0")
    ax.invert_yaxis()
    ax.set_xlabel("median ms per call")
    m = doc["meta"]
    ax.set_title(f"{m['shape']} | {m['gpu']} | ctx {m['context']} | commit {str(m['commit'])[:10]}", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(doc: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """`<stem>.json`, `<stem>.md` (and `<stem>.png`) under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    paths["md"].write_text(markdown(doc))
    png = plot(doc, out / f"{stem}.png")
    if png:
        paths["png"] = png
    return paths
