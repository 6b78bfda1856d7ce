"""Progress display of `train-drafter`: rich progress bars for generation and training, on stderr.

`ProgressReport` is the `report(kind, record)` callable that `pipeline.run` calls with "stage",
"gen", "log" (training steps), "record" (validation / generation summaries) and "save" events; it
prints nothing else.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ProgressReport:
    """Context manager and callable: renders pipeline events with rich."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        self.gen_task = None
        self.train_task = None

    def __enter__(self) -> "ProgressReport":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, kind: str, rec: dict) -> None:
        if kind == "stage":
            fields = ", ".join(f"{k}={v}" for k, v in rec.items() if k != "stage")
            self.console.log(f"[bold]{rec['stage']}[/bold] {fields}")
        elif kind == "gen":
            if self.gen_task is None:
                self.gen_task = self.progress.add_task("generate", total=rec["total"], info="")
            rate = f", {rec['tokens_per_s']:.0f} tok/s ({rec['engine']})" if "tokens_per_s" in rec else ""
            self.progress.update(self.gen_task, completed=rec["done"], total=rec["total"],
                                 info=f"{rec['done']}/{rec['total']} jobs{rate}")
        elif kind == "record":
            if rec.get("kind") == "val":
                tau = rec.get("val_tau")
                self.console.log(f"validation ({rec.get('phase')}) step {rec['step']}: loss {rec['val_loss']:.3f}, "
                                 f"tau {'-' if tau is None else f'{tau:.3f}'}, acc[1..4] {rec['val_acc'][:4]}")
            elif rec.get("kind") == "gen":
                self.console.log(f"generated jobs {rec['jobs']} ({rec['jobs_done']} now): {rec['sequences']} "
                                 f"sequences stored, {rec['new_tokens']} new tokens in {rec['seconds']} s = "
                                 f"{rec['tokens_per_s']:.0f} tok/s ({rec['engine']})")
        elif kind == "log":
            if self.train_task is None:
                self.train_task = self.progress.add_task("train", total=1.0, info="")
            tau = rec.get("tau")
            info = f"step {rec['step']} loss {rec['loss']:.3f} tau {tau if tau is not None else '-'} " \
                   f"{rec['tokens_per_s']:.0f} tok/s"
            self.progress.update(self.train_task, completed=rec["progress"], info=info)
        elif kind == "save":
            self.console.log(f"checkpoint at step {rec['step']}")
