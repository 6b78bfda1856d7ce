"""`python -m ddtctl` runs the command line."""

from ddtctl.cli.app import main

if __name__ == "__main__":
    main()
