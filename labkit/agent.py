"""`python -m labkit.agent --connect HOST:PORT`: what torchrun runs on every node so that its ranks attach to the
notebook that called `labkit.attach` (a short name for the command line;
labkit/launch/attached_rank.py does the work)."""

from labkit.launch.attached_rank import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
