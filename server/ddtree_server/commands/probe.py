"""`ddtree-server probe`: the GPU probe of the engine's speed (bench/probe.py), time-boxed.

    ddtree-server probe --out OUT [--budget-s 215] [--parts copy,stages,profile,tree,gemv,compile]
    ddtree-server probe --out OUT --phase2        # the kernel path on vs off (probe2.json)

Its arguments are the probe's own (`ddtree-server probe --help`); findings are kept under
docs/benchmarks/ (docs/benchmarks/README.md, "GPU probe").
"""

from __future__ import annotations

import typer


def probe(ctx: typer.Context) -> None:
    """GPU probe of the engine's speed: stage times at model shapes, per-kernel profile, GEMV, tree
    build, torch.compile; --phase2: the kernel path on vs off. Writes OUT/probe.json."""
    from ddtree_server.bench.probe import main

    raise typer.Exit(main(["--help"] if not ctx.args else list(ctx.args)))


def register(app: typer.Typer) -> None:
    """Add `probe` to the Typer app; every argument goes to the probe's own parser."""
    app.command("probe", add_help_option=False,
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(probe)
