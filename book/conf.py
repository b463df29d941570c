"""Sphinx's configuration of the course's website (`make book`): the web editions book/prepare.py wrote, as pages.

Why Sphinx with MyST-NB and the book theme (the engine of Jupyter Book 1): it builds from PyPI packages alone, pinned
in pyproject.toml's `book` extra, offline; Jupyter Book 2 (mystmd) downloads its page templates at build time, which
neither CI nor a laptop on a train can count on. The notebooks arrive executed (nb_execution_mode "off": MyST-NB
never runs them again) and stripped of what the site must not give away (book/web_edition.py). plotly.js is one
static file every page loads (the browser caches it): each figure is a <div> and a Plotly.newPlot call.
"""

import os
from pathlib import Path

project = "The Distributed Training Lab"
author = "The Distributed Training Lab's authors"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # executed by book/prepare.py, at 2 ranks
nb_merge_streams = True  # a cell's prints as one block, as JupyterLab shows them
nb_render_markdown_format = "gfm"  # outputs' Markdown with tables, as JupyterLab renders show_progress's table
myst_heading_anchors = 3  # "#the-bubble" anchors for ## and ### headings, as GitHub and JupyterLab make them
myst_enable_extensions = ["html_image"]  # no dollarmath: a "$" in the course is money, not LaTeX
exclude_patterns = ["_build"]
html_theme = "sphinx_book_theme"
html_title = project
html_favicon = "favicon.svg"  # beside this file; without one the browser asks for /favicon.ico and logs a 404
html_context = {"default_mode": "light"}  # the theme's light/dark switch starts light (no "invalid theme mode")
html_js_files = ["plotly.min.js"]  # once for the site (before the pages' scripts: it is loaded in <head>)
html_css_files = ["labkit-book.css"]
html_copy_source = False  # no _sources/: the site holds only what its pages show
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {
    "use_download_button": False,
    "use_fullscreen_button": False,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "secondary_sidebar_items": {"**": ["page-toc"], "index": []},  # the landing page's course map gets the width
}
repository = os.environ.get("BOOK_REPOSITORY_URL")  # set by the publishing workflow: the "repository" button
if repository:
    html_theme_options |= {"repository_url": repository, "use_repository_button": True}


def _static_of_the_sources(app, config):
    """The sources' _static/ (plotly.js and the CSS that book/prepare.py put there): Sphinx would look for
    html_static_path beside this file, not among the sources."""
    config.html_static_path = [*config.html_static_path, str(Path(app.srcdir) / "_static")]


def setup(app):
    app.connect("config-inited", _static_of_the_sources)
