"""What one `train-drafter` run starts from (train/pipeline.py describes the run): its options, the
frozen target, the clean prompt list, the mask token and the EOS ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddtree_server.train import contamination, data
from ddtree_server.train.own_target import OwnTarget, is_own_target_folder
from ddtree_server.train.prompts import load_prompts
from ddtree_server.train.trainer import TrainSettings

DEFAULT_MASK_TOKEN = "<empty_output>"
RESERVE_S = 25.0  # kept at the end of a time-limited run for the last validation and save


@dataclass
class PipelineOptions:
    """Everything `train-drafter` needs (paths, drafter shape, budgets)."""

    out_dir: Path
    work_dir: Path
    target_dir: Path | None = None
    gguf: Path | None = None
    prompts_source: Path | None = None        # wheel / ShareGPT JSON / prepared .jsonl.gz
    data_dir: Path | None = None              # folder of carried wheels
    eval_data_dir: Path | None = None         # folder of the evaluation wheels (default: data_dir)
    check_contamination: bool = True
    num_prompts: int = 4096
    passes: float = 1.0                       # jobs = passes x prompt pool (later passes sample)
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
    val_prompts: int = 160                    # at most a fifth of the prompts
    val_every_minutes: float = 1.0
    max_mb: float = 24.0                      # refuse drafters larger than this (bf16, 1 MB = 1e6 bytes)
    save_every_minutes: float = 2.0
    resume: bool = False                      # exact resume from work_dir/train_state.pt
    resume_from: Path | None = None           # a carried state folder (train/resume.py)
    state_dir: Path | None = None             # write the returnable state here
    device: str = "auto"
    prompt_shard: tuple[int, int] | None = None  # (i, n): answer only jobs i, i+n, i+2n, ...
    extra_data: list[Path] = field(default_factory=list)  # more shard folders (other processes)
    generate_only: bool = False               # stop after data generation (a data-only worker)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; other names as torch reads them."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_hf_target(opts: PipelineOptions, device: torch.device):
    """(model, tokenizer, target id) of the frozen target (bf16 on CUDA, fp32 on CPU). The id is
    the GGUF's sha256 prefix or the HF folder's path; a carried state must name the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if opts.gguf is not None:
        g = Path(opts.gguf)
        from ddtree_server.models.default import sha256_file

        kw = {"gguf_file": g.name}  # the id names the content, not the file name (pieces may differ)
        src, tid = g.parent, f"gguf-sha256:{sha256_file(g)[:16]}"
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


def clean_prompts(opts: PipelineOptions) -> tuple[list[str], list[dict], int]:
    """(training + validation prompts without evaluation copies, dropped records, reference count).
    Raises data.wheels.DataFileError when the evaluation wheels are missing."""
    prompts = load_prompts(opts.prompts_source, data_dir=opts.data_dir, seed=opts.gen.seed)
    if not opts.check_contamination:
        return prompts, [], 0
    index = contamination.load_index(opts.eval_data_dir or opts.data_dir, download=False)
    clean, dropped = contamination.drop_contaminated(prompts, index)
    return clean, dropped, index.size
