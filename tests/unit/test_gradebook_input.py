"""The gradebook's input (labkit.classroom): the cells it grades in the course's notebooks, the class list from
JupyterHub's REST API (a fake hub on loopback), and bad command lines. No users are made here: the grading itself,
as root with real students, is tests/distributed/test_gradebook.py."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from labkit.classroom._cells import graded_cells, setup_cells
from labkit.classroom._hub import hub_users
from labkit.classroom._regrade import grader_name
from labkit.classroom.gradebook import main
from labkit.exercises.progress import EXERCISES

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
WIDGETS = {"stack_map", "bug_zoo_diagnoses"}  # answered in a widget: no code cell calls their grader


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_each_exercise_has_one_graded_cell_after_setup_cells_that_import_its_grader(exercise):
    notebook = json.loads((NOTEBOOKS / f"{EXERCISES[exercise][0]}.ipynb").read_text())
    grader = grader_name(exercise)
    if exercise in WIDGETS:
        assert grader is None or graded_cells(notebook, grader) == []
        return
    graded = graded_cells(notebook, grader)
    assert len(graded) == 1 and "your turn" in graded[0][1]
    setup = setup_cells(notebook)
    assert [i for i, _ in setup] < [graded[0][0]] and "world_size =" in setup[0][1]
    assert grader in "".join(s for _, s in [*setup, *graded] if "import" in s)


def test_the_grader_of_every_exercise_is_found():
    assert grader_name("ring_allreduce") == "check_ring_allreduce"
    assert grader_name("bug_zoo_fix") == "check_fixed_training" and grader_name("one_f_one_b") == "check_1f1b_order"
    assert grader_name("bug_zoo_diagnoses") is None  # a widget's, recorded by record_attempt


class FakeHub(BaseHTTPRequestHandler):
    """GET /hub/api/users as JupyterHub 2+ pages it, for the token "admin" only; 3 users, 2 per page."""

    USERS = ["ada", "grace", "linus"]

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.headers.get("Authorization") != "token admin":
            self.send_error(403, "Forbidden")
            return
        query = parse_qs(urlparse(self.path).query)
        offset = int(query["offset"][0])
        page = {"items": [{"name": n, "admin": False} for n in self.USERS[offset:offset + 2]],
                "_pagination": {"offset": offset, "limit": 2, "total": 3,
                                "next": {"offset": offset + 2, "limit": 2} if offset + 2 < 3 else None}}
        body = json.dumps(page).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_hubs_users_are_read_page_by_page(hub):
    assert hub_users(hub, "admin") == ["ada", "grace", "linus"]
    assert hub_users(hub + "/hub/", "admin") == ["ada", "grace", "linus"]


def test_a_refused_token_or_none_says_what_to_do(hub):
    with pytest.raises(RuntimeError, match="403.*admin"):
        hub_users(hub, "student")
    with pytest.raises(ValueError, match="JUPYTERHUB_API_TOKEN"):
        hub_users(hub, "")


@pytest.mark.parametrize(("argv", "said"), [
    ([], "name the students"),
    (["--users", "root"], "never runs a student's code as root"),
    (["--users", "no-such-student-here"], "no local user 'no-such-student-here'"),
    (["--users", "root", "--exercises", "ring"], "invalid choice: 'ring'"),
    (["--users", "root", "--timeout-seconds", "0"], "must be positive"),
])
def test_bad_input_is_refused_with_a_message(argv, said, capsys):
    try:
        code = main(argv)
    except SystemExit as stopped:  # argparse's refusals
        code = stopped.code
    assert code == 2 and said in capsys.readouterr().err


def test_the_grading_process_gets_none_of_the_instructors_secrets(monkeypatch, tmp_path):
    from labkit.classroom._as_student import grading_environment

    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "admin-secret")
    monkeypatch.setenv("LABKIT_PROGRESS", "/root/.labkit/progress.json")
    monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", "4")  # the class's caps do apply
    env = grading_environment(tmp_path)
    assert "admin-secret" not in json.dumps(env)
    assert env["HOME"] == str(tmp_path) and env["LABKIT_PROGRESS"].startswith(str(tmp_path))
    assert env["LABKIT_MAX_WORLD_SIZE"] == "4"


def test_the_grading_process_gets_the_shared_servers_start_floor_unless_the_instructor_set_one(monkeypatch, tmp_path):
    from labkit.classroom import spawner
    from labkit.classroom._as_student import grading_environment

    monkeypatch.delenv("LABKIT_MIN_START_SECONDS", raising=False)
    monkeypatch.delenv("LABKIT_GRADING_TIME_SCALE", raising=False)
    env = grading_environment(tmp_path)
    traits = spawner.CourseSpawner.class_traits()  # the class's own defaults: the gradebook runs on its server
    assert float(env["LABKIT_MIN_START_SECONDS"]) == traits["min_start_seconds"].default_value
    assert float(env["LABKIT_GRADING_TIME_SCALE"]) == traits["grading_time_scale"].default_value
    monkeypatch.setenv("LABKIT_MIN_START_SECONDS", "15")
    assert grading_environment(tmp_path)["LABKIT_MIN_START_SECONDS"] == "15"
