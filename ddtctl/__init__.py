"""ddtctl: deploy, check and smoke-test speculative-decoding LLM servers on Proxmox LXC fleets."""

__version__ = "0.1.0"
