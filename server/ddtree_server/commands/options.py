"""Option parsers shared by the sub-commands."""

from __future__ import annotations

import typer


def int_list(text: str) -> list[int]:
    """``"1, 10,19"`` -> ``[1, 10, 19]``; raises typer.BadParameter (exit 2) on anything else."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def run_single(command) -> None:
    """Run one command function as a program (the ``python -m`` entry points) with click's plain
    help, like the ``ddtree-server`` CLI (Typer's Rich help shows ``<bool>`` for flags)."""
    from ddtree_server.commands.help_format import PlainHelpCommand

    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command(cls=PlainHelpCommand)(command)
    app()


def budget_list(text: str, option: str = "--budgets") -> list[int]:
    """``"16,64"`` -> ``[16, 64]``: a non-empty list of DDTree budgets >= 1 (the API's range starts
    at 1); raises typer.BadParameter naming the option otherwise."""
    try:
        values = int_list(text)
    except typer.BadParameter as exc:
        raise typer.BadParameter(f"{option}: {exc}") from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{option}: give budgets >= 1, e.g. 16,64 (got {text!r})")
    return values


def check_device(name: str, option: str = "--device") -> str:
    """``auto | cpu | cuda | cuda:N`` -> the device to use ('auto' resolved), checked before any
    model loads; raises typer.BadParameter for other names, CUDA absent or a missing GPU index."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    kind, _, index = name.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise typer.BadParameter(f"{option} {name!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise typer.BadParameter(f"{option} {name}: CUDA is not available on this machine (use cpu)")
    if index and int(index) >= torch.cuda.device_count():
        raise typer.BadParameter(f"{option} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


# serve/generate flags whose ServerConfig field has another name
_FLAG_OF_FIELD = {"drain_timeout_s": "--drain-timeout"}


def config_errors(exc) -> list[str]:
    """A ServerConfig ValidationError as `error: --flag: message` lines (the flag as typed;
    `config` for checks over several flags), without pydantic's "Value error, " prefix."""
    lines = []
    for err in exc.errors():
        field = "_".join(str(p) for p in err["loc"])
        where = _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-")) if field else "config"
        lines.append(f"error: {where}: {err['msg'].removeprefix('Value error, ')}")
    return lines


def seed_range(value: int | None) -> int | None:
    """Callback of --seed: the sampling generator takes a signed 64-bit seed (as the API's `seed`)."""
    if value is not None and not -(2**63) <= value < 2**63:
        raise typer.BadParameter("must be in the signed 64-bit range (-2^63 .. 2^63-1)")
    return value


def top_p_range(value: float) -> float:
    """Callback of --top-p: nucleus mass in (0, 1] (as the API's `top_p`)."""
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter("must be in (0, 1]")
    return value
