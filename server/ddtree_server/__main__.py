"""`python -m ddtree_server ...` runs the `ddtree-server` command line."""

from ddtree_server.cli import app

if __name__ == "__main__":
    app(prog_name="ddtree-server")
