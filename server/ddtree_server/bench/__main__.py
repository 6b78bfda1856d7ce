"""`python -m ddtree_server.bench [OPTIONS]`: the bench command without the rest of the CLI.

For a GPU host without the serving dependencies (fastapi, pydantic, ...); needs torch,
transformers, safetensors, rich, typer, matplotlib (for the PNG) and gguf for a GGUF target.
"""

from ddtree_server.commands.bench import bench

if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(bench)
