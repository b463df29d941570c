"""What notebooks 08 and 11 to 14 print, as a student reads it at 1280 px with the file browser open (JupyterLab's
first layout): no printed line wraps. JupyterLab breaks a text output's long line at any character (word-break:
break-all), mid-word ("instea" + "d"), and no setting or override changes that, so every line a notebook prints
fits: at most labkit.tables.LINE_CHARS (100) characters, where 107 fit.

(Kept to the notebooks that print their own results: the notebooks that show a caught RankError or a hang report
print torch's and gloo's own long lines too, which labkit does not write.)"""

from playwright.sync_api import Page
from settle import wait_for_layout

from labkit.tables import LINE_CHARS

NOTEBOOKS = ("08_worked_example_7b.ipynb", "11_zero.ipynb", "12_fsdp.ipynb", "13_3d_parallelism.ipynb",
             "14_3d_layouts.ipynb")

PRINTED = ('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"] pre, '
           '.jp-OutputArea-output[data-mime-type="text/plain"] pre')
WRAPPED_LINES = """() => [...document.querySelectorAll('PRINTED')].flatMap(pre => {
  const s = getComputedStyle(pre), canvas = document.createElement('canvas').getContext('2d');
  canvas.font = `${s.fontSize} ${s.fontFamily}`;
  const fits = Math.floor(pre.clientWidth / canvas.measureText('0').width);
  return pre.textContent.split('\\n').filter(line => line.length > fits)
            .map(line => `${line.length} > ${fits} characters: ${line.slice(0, 100)}`); })"""
WRAPPED_LINES = WRAPPED_LINES.replace("PRINTED", PRINTED)


def check(page: Page, cells: list[dict]) -> None:
    page.set_viewport_size({"width": 1280, "height": 900})
    page.evaluate("() => window.jupyterapp.shell.activateById('filebrowser')")
    wait_for_layout(page)
    wrapped = page.evaluate(WRAPPED_LINES)
    assert not wrapped, (f"{len(wrapped)} printed lines wrap, mid-word, at 1280 px with the file browser open; "
                         f"print at most {LINE_CHARS} characters a line:\n" + "\n".join(wrapped))
