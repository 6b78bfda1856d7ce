"""Sub-commands of `ddtree-server`, one module each; every module exposes `register(app)`."""
