"""The course as a class on one server: what the instructor runs across the students' accounts.

    gradebook   `python -m labkit.classroom.gradebook`: every student's "your turn" cells re-graded in fresh
                processes run as the student, one table and a CSV, the students' progress files beside it

Its private modules: _cells (which cells of a notebook grade an exercise), _regrade (the grading process, run as
the student), _as_student (starting it so: uid, HOME, time limit, process group), _hub (the class list from
JupyterHub's REST API).
"""

__all__: list[str] = []
