"""A test student at the class's hub, as a browser would be: log in, start the server, open a kernel, run cells.

Everything goes through the hub's public port (the proxy): the login form (with its _xsrf cookie, as JupyterHub's
login page posts it), the hub's REST API (https://jupyterhub.readthedocs.io/en/stable/reference/rest-api.html)
to start the server and make a token, and Jupyter Server's REST API and kernel websocket
(https://jupyter-server.readthedocs.io/en/latest/developers/websocket-protocols.html: one JSON message per frame,
its channel named in it) to run code on the course's kernel.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import requests
import websocket


@dataclass
class Reply:
    """What a cell printed (stream and display text, joined) and its error, if it raised (`ename: evalue`)."""

    output: str
    error: str | None
    seconds: float


@dataclass
class Student:
    """One student's session at the hub at `base` (http://127.0.0.1:PORT)."""

    base: str
    name: str
    password: str
    session: requests.Session = field(default_factory=requests.Session)
    token: str = ""

    def log_in(self) -> None:
        """The hub's login form, as the login page posts it; then a token of the student's own for the APIs."""
        self.session.get(f"{self.base}/hub/login", timeout=30).raise_for_status()
        xsrf = self.session.cookies.get("_xsrf", path="/hub/")
        answer = self.session.post(f"{self.base}/hub/login", timeout=60, allow_redirects=False,
                                   data={"username": self.name, "password": self.password, "_xsrf": xsrf})
        if answer.status_code != 302:
            raise PermissionError(f"{self.name}: the hub refused the login ({answer.status_code})")
        # The _xsrf token is tied to the login session: a page loaded after the login sets the one the API wants.
        self.session.get(f"{self.base}/hub/home", timeout=30).raise_for_status()
        xsrf = self.session.cookies.get("_xsrf", path="/hub/")
        made = self.session.post(f"{self.base}/hub/api/users/{self.name}/tokens", timeout=30,
                                 headers={"X-XSRFToken": xsrf}, json={"note": "hub test", "expires_in": 3600})
        made.raise_for_status()
        self.token = made.json()["token"]

    def api(self, method: str, path: str, **kwargs) -> requests.Response:
        """A request with the student's token: /hub/api/... to the hub, /user/NAME/api/... to their server."""
        headers = {"Authorization": f"token {self.token}"}
        return requests.request(method, f"{self.base}{path}", headers=headers, timeout=kwargs.pop("timeout", 60),
                                **kwargs)

    def start_server(self, timeout_seconds: float = 180) -> None:
        """Start the student's server and wait until the hub says it is ready."""
        answer = self.api("POST", f"/hub/api/users/{self.name}/server")
        if answer.status_code not in (201, 202, 400):  # 400: already running
            raise RuntimeError(f"{self.name}: server start answered {answer.status_code}: {answer.text[:300]}")
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            server = self.api("GET", f"/hub/api/users/{self.name}").json().get("servers", {}).get("", {})
            if server.get("ready"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: the server was not ready after {timeout_seconds:.0f} s")

    def open_kernel(self, kernel_name: str = "labkit") -> Kernel:
        answer = self.api("POST", f"/user/{self.name}/api/kernels", json={"name": kernel_name})
        answer.raise_for_status()
        return Kernel(self, answer.json()["id"])


class Kernel:
    """A kernel of the student's server, driven over its websocket like JupyterLab's notebook panel."""

    def __init__(self, student: Student, kernel_id: str):
        self.student, self.id = student, kernel_id
        url = student.base.replace("http", "ws", 1) + f"/user/{student.name}/api/kernels/{kernel_id}/channels"
        self.socket = websocket.create_connection(url, header=[f"Authorization: token {student.token}"],
                                                  timeout=30)

    def execute(self, code: str, timeout_seconds: float = 300) -> Reply:
        """Run `code` as one cell; its output and error once the kernel is idle again."""
        started = time.monotonic()
        msg_id = uuid.uuid4().hex
        self.socket.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": self.student.name,
                       "session": uuid.uuid4().hex, "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        output, error, idle = [], None, False
        while not idle:
            if time.monotonic() - started > timeout_seconds:
                raise TimeoutError(f"{self.student.name}: a cell ran past {timeout_seconds:.0f} s: {code[:80]!r}")
            self.socket.settimeout(max(1.0, timeout_seconds - (time.monotonic() - started)))
            message = json.loads(self.socket.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                output.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                output.append(content.get("data", {}).get("text/plain", ""))
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return Reply("".join(output), error, time.monotonic() - started)

    def close(self) -> None:
        self.socket.close()
