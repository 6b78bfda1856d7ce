"""`python -m ddtree_server.train [OPTIONS]`: the train-drafter command without the rest of the CLI.

Useful on a GPU host that lacks the serving dependencies (fastapi, pydantic, ...): only torch,
transformers, safetensors, rich and typer are imported (plus gguf for a GGUF target).
"""

from ddtree_server.commands.train import train_drafter

if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(train_drafter)
