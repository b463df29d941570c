"""Command-line entry points: `python -m labkit.commands.<name>`, each a module with a `main()`.

    allreduce_check  labkit's AllReduce under torchrun, on one machine or several, checked against torch's
    gpu_check        `make gpu-check`: what labkit sees on this machine's GPUs, and its kernels against torch's there

Nothing here is imported by the rest of labkit: these modules use the package, as a student's script would.
"""

__all__ = []
