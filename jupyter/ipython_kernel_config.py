# The course's kernels, installed by `make setup` into .venv/etc/ipython/ (IPython reads its config there, for every
# kernel of that environment): ipywidgets' comm targets registered as a kernel starts. JupyterLab's widget manager
# opens a "jupyter.widget.control" comm to a new kernel at once, to fetch its widgets; before a cell has imported
# ipywidgets the kernel has no such target and logs "No such comm target registered" and twice "No such comm",
# which JupyterLab's log badge counts (harmless, ipywidgets' maintainers say: jupyter-widgets/ipywidgets#3525).
c.InteractiveShellApp.extensions = ["ipywidgets"]  # noqa: F821 - `c`, the config IPython hands this file
