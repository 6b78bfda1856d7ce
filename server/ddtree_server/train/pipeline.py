"""`train-drafter` end to end: target -> prompts -> self-generated data -> training -> checkpoint.

Layout of the folders:
  work_dir/data/shard_*.pt    generated sequences (resumable, see train/data.py)
  work_dir/train_state.pt     fp32 weights + optimizer + step (for --resume)
  out_dir/config.json, model.safetensors   the servable z-lab drafter (bf16)
  out_dir/train_log.jsonl     one JSON record per logged step (+ validation records)
  out_dir/summary.json        settings, data counts, timings, final validation metrics, versions

Default drafter for SmolLM2-135M (30 layers, hidden 576): 3 draft layers with the target's widths
(9/3 heads, head_dim 64, MLP 1536) fed by target layers [1, 10, 19, 27]: one early layer (token
identity), two evenly spaced middle layers, and layer 27 = T-3, the deepest layer the reference
default rule uses (the last two layers specialise in the output distribution). Four ids instead of
three cost only 0.33 M parameters in `fc`; the whole drafter is 11.95 M parameters = 23.90 MB in
bf16, under the 24 MB limit (`--max-mb`).

Mask token for SmolLM2: `<empty_output>` (id 16), a reserved control token of its StarCoder-style
vocabulary that the chat template never emits and the instruct model never produces (responses
containing the mask id are dropped from training anyway). Other targets must name one explicitly.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ddtree_server.train import build, checkpoint, data
from ddtree_server.train.own_target import OwnTarget, is_own_target_folder
from ddtree_server.train.prompts import load_prompts
from ddtree_server.train.trainer import Trainer, TrainSettings, evaluate

DEFAULT_MASK_TOKEN = "<empty_output>"


@dataclass
class PipelineOptions:
    """Everything `train-drafter` needs (paths, drafter shape, budgets)."""

    out_dir: Path
    work_dir: Path
    target_dir: Path | None = None
    gguf: Path | None = None
    prompts_source: Path | None = None        # wheel / ShareGPT JSON / prepared .jsonl.gz
    data_dir: Path | None = None              # folder of carried wheels
    num_prompts: int = 4096
    gen: data.GenSettings = field(default_factory=data.GenSettings)
    layers: int = 3
    layer_ids: list[int] = field(default_factory=lambda: [1, 10, 19, 27])
    block_size: int = 16
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    init: str = "random"
    init_from: Path | None = None             # start from this z-lab drafter's weights (same shape)
    train: TrainSettings = field(default_factory=TrainSettings)
    max_minutes: float = 0.0                  # whole command; 0 = no limit (then train.steps > 0)
    gen_minutes: float = 0.0                  # cap on data generation; 0 = no cap
    max_seq_len: int = 512
    val_fraction: float = 0.02
    max_mb: float = 24.0                      # refuse drafters larger than this (bf16, 1 MB = 1e6 bytes)
    save_every_minutes: float = 2.0
    resume: bool = False
    device: str = "auto"
    prompt_shard: tuple[int, int] | None = None  # (i, n): answer only prompts i, i+n, i+2n, ...
    extra_data: list[Path] = field(default_factory=list)  # more shard folders (other processes)
    generate_only: bool = False               # stop after data generation (a data-only worker)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_hf_target(opts: PipelineOptions, device: torch.device):
    """(model, tokenizer, target id) of the frozen target (bf16 on CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if opts.gguf is not None:
        g = Path(opts.gguf)
        kw = {"gguf_file": g.name}
        src, tid = g.parent, f"{g.name}:{g.stat().st_size}"
    elif opts.target_dir is not None:
        kw, src, tid = {}, Path(opts.target_dir), str(Path(opts.target_dir).resolve())
        if is_own_target_folder(src):  # Qwen3.5 / Qwen3.6 hybrids: our own forward (train/own_target.py)
            from ddtree_server.models.load import load_target

            loaded = load_target(src, device=str(device), dtype=dtype)
            return OwnTarget(loaded.model, loaded.eos_token_ids), loaded.tokenizer, tid
    else:
        raise ValueError("give --target DIR or --gguf FILE")
    tok = AutoTokenizer.from_pretrained(src, **kw)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw).to(device).eval().requires_grad_(False)
    return model, tok, tid


def pick_mask_token(tokenizer, given: int | None) -> int:
    """The mask id: `given`, else SmolLM2's reserved `<empty_output>`; ValueError if neither exists."""
    if given is not None:
        return given
    tid = tokenizer.convert_tokens_to_ids(DEFAULT_MASK_TOKEN)
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
        return tid
    raise ValueError(f"this tokenizer has no {DEFAULT_MASK_TOKEN}; pass --mask-token-id (an unused reserved id)")


def eos_ids(model, tokenizer) -> list[int]:
    out: list[int] = []
    for v in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x not in out:
                out.append(x)
    return out


def run(opts: PipelineOptions, report: Callable[[str, dict], None] = lambda kind, rec: None) -> dict:
    """Run the pipeline; report(kind, record) receives "stage" / "gen" / "log" / "save" events.
    Returns the summary dict (also written to out_dir/summary.json)."""
    t0 = time.monotonic()
    dev = _device(opts.device)
    torch.manual_seed(opts.train.seed)
    out, work = Path(opts.out_dir), Path(opts.work_dir)
    for extra in opts.extra_data:  # before the slow steps; the target id is checked once known
        data.check_extra_folder(extra, work / "data")
    out.mkdir(parents=True, exist_ok=True)
    report("stage", {"stage": "load target", "device": str(dev)})
    model, tok, tid = load_hf_target(opts, dev)
    for extra in opts.extra_data:
        data.check_extra_folder(extra, work / "data", tid, opts.prompt_shard)
    mask_id = pick_mask_token(tok, opts.mask_token_id)
    config = build.new_drafter_config(model.config, num_layers=opts.layers, layer_ids=opts.layer_ids,
                                      block_size=opts.block_size, mask_token_id=mask_id,
                                      intermediate_size=opts.intermediate_size)
    drafter = checkpoint.new_or_resumed(config, model.get_input_embeddings(), model.get_output_embeddings(), dev)
    size = build.drafter_bytes(drafter)
    if size > opts.max_mb * 1e6:
        raise ValueError(f"drafter would be {size / 1e6:.1f} MB in bf16 > --max-mb {opts.max_mb}")

    report("stage", {"stage": "prompts"})
    prompts = load_prompts(opts.prompts_source, data_dir=opts.data_dir, n=opts.num_prompts, seed=opts.gen.seed)
    deadline = t0 + opts.gen_minutes * 60 if opts.gen_minutes else None
    report("stage", {"stage": "generate", "prompts": len(prompts)})
    t_gen = time.monotonic()
    data.generate_shards(model, tok, prompts, work / "data", opts.gen, eos_ids=eos_ids(model, tok),
                                 mask_token_id=mask_id, target_id=tid, deadline=deadline, shard=opts.prompt_shard,
                                 progress=lambda d, t: report("gen", {"done": d, "total": t}))
    gen_s = time.monotonic() - t_gen
    if opts.generate_only:
        stored = len(data.load_sequences(work / "data", opts.max_seq_len))
        report("stage", {"stage": "done", "sequences": stored, "gen_seconds": round(gen_s, 1)})
        return {"target": tid, "prompts": len(prompts), "sequences": stored, "gen_seconds": round(gen_s, 1)}
    seen: set[str] = set()

    def arrived() -> list[data.Sequence]:  # shards of the other workers not loaded yet
        return [q for d in opts.extra_data for q in data.load_sequences(d, opts.max_seq_len, seen)]

    seqs = data.load_sequences(work / "data", opts.max_seq_len, seen) + arrived()
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(opts.train.seed)).tolist()
    n_val = min(len(seqs) // 2, max(8, int(len(seqs) * opts.val_fraction)))
    val, train = [seqs[i] for i in order[:n_val]], [seqs[i] for i in order[n_val:]]

    state_path = work / "train_state.pt"
    settings = opts.train
    if opts.max_minutes:
        left = opts.max_minutes - (time.monotonic() - t0) / 60 - 0.5  # keep 30 s for evaluation + save
        settings = replace(settings, max_minutes=max(0.1, left))
    trainer = Trainer(drafter, model, train, settings)
    if opts.extra_data:
        trainer.more = arrived
    if opts.resume and state_path.exists():
        checkpoint.load_checkpoint(trainer, state_path)
        report("stage", {"stage": "resumed", "step": trainer.step})
    elif opts.init_from is not None:
        build.load_weights(drafter, opts.init_from, model)
        report("stage", {"stage": "initialised", "from": str(opts.init_from)})
    else:
        build.init_drafter(drafter, model, opts.init, seed=settings.seed)
    log_path = out / "train_log.jsonl"
    with open(log_path, "a", encoding="utf-8") as log:
        def on_log(rec: dict) -> None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
            report("log", rec)

        def on_save(step: int) -> None:
            checkpoint.save_checkpoint(trainer, out, state_path)
            report("save", {"step": step})

        report("stage", {"stage": "train", "sequences": len(train), "val": len(val),
                         "budget_min": settings.max_minutes, "steps": settings.steps})
        t_train = time.monotonic()
        last = trainer.run(on_log, on_save, opts.save_every_minutes * 60)
        train_s = time.monotonic() - t_train
        checkpoint.save_checkpoint(trainer, out, state_path)
        metrics = evaluate(trainer.drafter, model, val, settings)
        log.write(json.dumps({"step": trainer.step, **metrics}) + "\n")
    summary = {
        "target": tid, "mask_token_id": mask_id, "mask_token": tok.convert_ids_to_tokens(mask_id),
        "drafter_config": config.to_dict(), "drafter_bytes_bf16": size,
        "init": str(opts.init_from) if opts.init_from else opts.init,
        "prompts": len(prompts), "sequences": len(val) + len(trainer.seqs), "val_sequences": len(val),
        "tokens": int(sum(len(s.ids) for s in val + trainer.seqs)), "gen_seconds": round(gen_s, 1),
        "extra_data": [str(d) for d in opts.extra_data],
        "train_seconds": round(train_s, 1), "steps": trainer.step, "last_log": last, **metrics,
        "gen_settings": asdict(opts.gen), "train_settings": asdict(settings), "device": str(dev),
        "torch": torch.__version__, "total_seconds": round(time.monotonic() - t0, 1),
    }
    if dev.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(dev)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report("stage", {"stage": "done", **metrics})
    return summary
