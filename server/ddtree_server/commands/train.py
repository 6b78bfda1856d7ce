"""`ddtree-server train-drafter`: train a DFlash drafter for a target on its own ShareGPT answers.

Example (CPU smoke):  ddtree-server train-drafter --out /tmp/d --work-dir /tmp/w --num-prompts 8 \\
    --max-new-tokens 32 --steps 3 --batch-size 2
The output folder is a z-lab drafter (config.json + model.safetensors) that `serve --drafter` loads.
In pieces on machines that keep nothing: `--state-out DIR` writes the returnable state
(train/resume.py) and `--resume-from DIR` continues from it. SIGTERM / Ctrl-C end the run at the
next batch or step with a final save; a second one stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from ddtree_server.commands.options import check_device, int_list


@contextlib.contextmanager
def _stop_on_signals():
    """Yields an event set by the first SIGTERM / SIGINT; the second one restores the default
    action and re-raises it (kills / interrupts at once). The previous handlers come back on exit."""
    stop = threading.Event()

    def handler(signum, _frame):
        if stop.is_set():
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        stop.set()

    sigs = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    old = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield stop
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)


def train_drafter(
    out: Path = typer.Option(..., "--out", help="Output folder of the drafter (z-lab format)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Data shards + resumable state (OUT/../<name>-work)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target as an HF folder."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="Target as a GGUF file (the embedded SmolLM2)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="ShareGPT wheel / JSON or prepared .jsonl.gz (pinned wheel)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Folder of already-downloaded wheels."),
    eval_data_dir: Optional[Path] = typer.Option(None, "--eval-data-dir", help="Folder of the evaluation-set "
                                                 "wheels for the contamination check (default: --data-dir, cache)."),
    num_prompts: int = typer.Option(4096, help="Size of the prompt pool (validation prompts excluded)."),
    passes: float = typer.Option(1.0, help="Jobs = passes x pool; passes after the first sample new answers."),
    val_prompts: int = typer.Option(160, help="Validation prompts (the last of the list; at most a fifth)."),
    val_every_minutes: float = typer.Option(1.0, help="Validation interval while training."),
    max_prompt_tokens: int = typer.Option(256, help="Skip longer chat-formatted prompts."),
    max_new_tokens: int = typer.Option(256, help="Response length cap (tokens)."),
    gen_batch_size: int = typer.Option(256, help="Prompts per generate() call."),
    sampled_fraction: float = typer.Option(0.25, help="Share of prompts answered by sampling (rest greedy)."),
    temperature: float = typer.Option(0.8, help="Sampling temperature for the sampled share."),
    gen_engine: str = typer.Option("static", help="static (batched static KV cache) | hf (generate())."),
    layers: int = typer.Option(3, "--layers", help="Draft layers."),
    target_layer_ids: str = typer.Option("1,10,19,27", help="Target layers whose outputs feed the drafter."),
    block_size: int = typer.Option(16, help="Draft block size (bonus + block_size-1 drafts)."),
    intermediate_size: Optional[int] = typer.Option(None, help="Draft MLP width (the target's)."),
    mask_token_id: Optional[int] = typer.Option(None, help="Mask token id (SmolLM2: <empty_output> = 16)."),
    init: str = typer.Option("random", help="random | target-first | target-last (see train/build.py)."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start from this drafter folder's weights."),
    steps: int = typer.Option(0, help="Optimizer steps (0 = until the time budget)."),
    max_minutes: float = typer.Option(0.0, help="Wall budget of the whole command (0 = none)."),
    gen_minutes: float = typer.Option(0.0, help="Cap on data generation time (0 = none)."),
    batch_size: int = typer.Option(16, help="Sequences per step."),
    anchors: int = typer.Option(48, help="Anchor blocks per sequence."),
    max_seq_len: int = typer.Option(512, help="Tokens per training sequence (prompt + response)."),
    lr: float = typer.Option(6e-4, help="Peak learning rate (AdamW)."),
    warmup_steps: int = typer.Option(50, help="Linear warm-up steps."),
    gamma: float = typer.Option(7.0, help="Loss weight decay over in-block positions."),
    row_sample: bool = typer.Option(False, "--row-sample/--no-row-sample", help="LM head on importance-sampled "
                                    "block rows (same expected loss, ~44% of the rows)."),
    bucket: int = typer.Option(8, help="Batches per length-sorted window (1: random batches)."),
    seed: int = typer.Option(0, help="Seed of prompt order, sampling, anchors and batches."),
    max_mb: float = typer.Option(24.0, help="Refuse drafters larger than this many MB in bf16."),
    save_every_minutes: float = typer.Option(2.0, help="Checkpoint interval."),
    resume: bool = typer.Option(False, "--resume", help="Continue from WORK_DIR/train_state.pt."),
    resume_from: Optional[Path] = typer.Option(None, "--resume-from", help="Continue from a state folder "
                                               "written by --state-out (fresh optimizer)."),
    state_out: Optional[Path] = typer.Option(None, "--state-out", help="Write the returnable state here "
                                             "(<= 8 files of <= 15 MiB)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N."),
    prompt_shard: Optional[str] = typer.Option(None, help="I/N: answer only every N-th prompt from the I-th "
                                               "(several GPUs generating disjoint data)."),
    extra_data: list[Path] = typer.Option([], "--extra-data", help="More shard folders to train on "
                                          "(re-read every minute while training); repeatable."),
    generate_only: bool = typer.Option(False, "--generate-only", help="Stop after data generation."),
) -> None:
    """Train a DFlash drafter for the target on its own answers to ShareGPT prompts."""
    from rich.console import Console

    from ddtree_server.data.wheels import DataFileError
    from ddtree_server.train.data import GenSettings
    from ddtree_server.train.pipeline import PipelineOptions, run
    from ddtree_server.train.report import ProgressReport
    from ddtree_server.train.trainer import TrainSettings

    if gen_engine not in ("static", "hf"):
        raise typer.BadParameter(f"--gen-engine {gen_engine!r}: use static or hf")
    if passes <= 0 or val_prompts < 0 or bucket < 1:
        raise typer.BadParameter("--passes must be > 0, --val-prompts >= 0, --bucket >= 1")
    if resume_from is not None and not (resume_from / "progress.json").is_file():
        raise typer.BadParameter(f"--resume-from {resume_from}: no progress.json (not a state folder)")
    if target is None and gguf is None:
        from ddtree_server.models.default import default_gguf_path

        gguf = default_gguf_path()
    opts = PipelineOptions(
        out_dir=out, work_dir=work_dir or out.parent / f"{out.name}-work", target_dir=target, gguf=gguf,
        prompts_source=prompts, data_dir=data_dir, eval_data_dir=eval_data_dir, num_prompts=num_prompts,
        passes=passes, val_prompts=val_prompts, val_every_minutes=val_every_minutes,
        gen=GenSettings(max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                        batch_size=gen_batch_size, sampled_fraction=sampled_fraction,
                        temperature=temperature, seed=seed, engine=gen_engine),
        layers=layers, layer_ids=int_list(target_layer_ids), block_size=block_size,
        intermediate_size=intermediate_size, mask_token_id=mask_token_id, init=init, init_from=init_from,
        train=TrainSettings(steps=steps, batch_size=batch_size, anchors=anchors, lr=lr,
                            warmup_steps=warmup_steps, gamma=gamma, seed=seed, row_sample=row_sample,
                            bucket=bucket),
        max_minutes=max_minutes, gen_minutes=gen_minutes, max_seq_len=max_seq_len, max_mb=max_mb,
        save_every_minutes=save_every_minutes, resume=resume, resume_from=resume_from, state_dir=state_out,
        device=device,
        prompt_shard=_shard(prompt_shard), extra_data=list(extra_data), generate_only=generate_only)
    if steps <= 0 and max_minutes <= 0 and not generate_only:
        raise typer.BadParameter("give --steps or --max-minutes")
    opts.device = check_device(device)
    console = Console(stderr=True)
    try:
        with _stop_on_signals() as stop, ProgressReport(console) as report:
            summary = run(opts, report, should_stop=stop.is_set)
    except (ValueError, OSError, DataFileError) as exc:
        console.print(f"[red]train-drafter failed:[/red] {exc}")
        raise typer.Exit(1) from None
    if generate_only:
        console.print(f"{summary['sequences']} sequences stored ({summary['gen_seconds']} s of generation)")
        return
    tau = summary.get("val_tau")
    console.print(f"drafter written to {out} ({summary['steps']} steps, "
                  f"val tau {'-' if tau is None else f'{tau:.2f}'}, {summary['total_seconds']} s)")


def _shard(text: str | None) -> tuple[int, int] | None:
    """"I/N" -> (I, N); raises typer.BadParameter unless 0 <= I < N."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise typer.BadParameter(f"--prompt-shard wants I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise typer.BadParameter(f"--prompt-shard {text}: need 0 <= I < N")
    return i, n


def register(app: typer.Typer) -> None:
    """Add `train-drafter` to the Typer app."""
    app.command("train-drafter")(train_drafter)
