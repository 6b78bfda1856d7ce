"""Own GPU kernels (Triton), each with a pure-torch reference that the CPU tests compare against."""
