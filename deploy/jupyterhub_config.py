"""JupyterHub for a class on one server: `sudo make hub` (README, "A class on one server").

Each student logs in with their own Unix account (PAM, the system's passwords, by default), and their single-user
server runs as that user (labkit.classroom.spawner.CourseSpawner) with the course's kernel, a copy of the
notebooks made at first login (~/my-notebooks), the class's caps, and bounds of their own. The Makefile passes
the instructor's choices as environment variables (defaults in brackets):

    LABKIT_HUB_IP, LABKIT_HUB_PORT     where the hub listens [127.0.0.1, 8000]; put TLS in front before 0.0.0.0
    LABKIT_HUB_STATE                   the hub's database, cookie secret, proxy and gradebook tokens [.hub]
    LABKIT_CLASS_LIST                  a file of user names, one per line: only they may log in [anyone with a
                                       Unix account on the machine may]
    LABKIT_HUB_ADMINS                  the instructors' user names, separated by spaces
    LABKIT_CLASS_WORLD_SIZE            ranks per call, per student [4]
    LABKIT_CLASS_THREADS_PER_RANK      torch threads per rank [1]
    LABKIT_CLASS_MEMORY_GIB            memory per student, all their processes together [4]
    LABKIT_CLASS_CPU_CORES             CPU per student, in cores [2]

Another authenticator (GitHub, LDAP, the university's OAuth) is one line: c.JupyterHub.authenticator_class; see
https://jupyterhub.readthedocs.io/en/stable/reference/authenticators.html. A test loads this file and changes
only that (tests/hub/hub_config.py).
"""

import os
import secrets
from pathlib import Path

from labkit.classroom.interpreter import class_python
from labkit.classroom.spawner import CourseSpawner

c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)

REPOSITORY = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("LABKIT_HUB_STATE", REPOSITORY / ".hub")).resolve()
STATE.mkdir(mode=0o700, exist_ok=True)
os.chmod(STATE, 0o700)  # the database holds every student's tokens


def state_secret(name: str) -> str:
    """A random token kept in STATE (0600), made on the hub's first start and the same at every start after."""
    path = STATE / name
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
    return path.read_text().strip()


c.JupyterHub.ip = os.environ.get("LABKIT_HUB_IP", "127.0.0.1")
c.JupyterHub.port = int(os.environ.get("LABKIT_HUB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"  # the hub's own API: for the proxy and the students' servers, on this host only
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
c.ConfigurableHTTPProxy.auth_token = state_secret("proxy-token")
c.ConfigurableHTTPProxy.command = [str(REPOSITORY / "deploy" / "node_modules" / ".bin" / "configurable-http-proxy")]
c.ConfigurableHTTPProxy.pid_file = str(STATE / "proxy.pid")
c.JupyterHub.cleanup_servers = True  # the hub's stop stops every student's server: nothing left running

c.JupyterHub.authenticator_class = "pam"
if os.environ.get("LABKIT_CLASS_LIST"):
    names = Path(os.environ["LABKIT_CLASS_LIST"]).read_text().split()
    c.Authenticator.allowed_users = {name for name in names if not name.startswith("#")}
else:
    c.Authenticator.allow_all = True  # PAM: anyone with an account on this machine
c.Authenticator.admin_users = set(os.environ.get("LABKIT_HUB_ADMINS", "").split())

# The gradebook (python -m labkit.classroom.gradebook --hub ...) lists the class with this token: read-only.
c.JupyterHub.services = [{"name": "gradebook", "api_token": state_secret("gradebook-token")}]
c.JupyterHub.load_roles = [{"name": "gradebook", "scopes": ["list:users", "read:users"], "services": ["gradebook"]}]

c.JupyterHub.spawner_class = CourseSpawner
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~/my-notebooks"
c.Spawner.args = [
    "--KernelSpecManager.allowed_kernelspecs=labkit",  # the course's kernel, as `make lab` runs it
    "--ServerApp.port_retries=0",  # a port taken meanwhile: fail and say so, never listen where the hub does not look
]
c.Spawner.start_timeout = 120  # 30 students logging in at 9:00 start their servers on the same cores
c.Spawner.http_timeout = 120
c.CourseSpawner.course_notebooks = str(REPOSITORY / "notebooks")
c.CourseSpawner.python = str(class_python())  # one every student may run
c.CourseSpawner.max_world_size = int(os.environ.get("LABKIT_CLASS_WORLD_SIZE", "4"))
c.CourseSpawner.threads_per_rank = int(os.environ.get("LABKIT_CLASS_THREADS_PER_RANK", "1"))
c.CourseSpawner.memory_nbytes = int(float(os.environ.get("LABKIT_CLASS_MEMORY_GIB", "4")) * 1024**3)
c.CourseSpawner.cpu_cores = float(os.environ.get("LABKIT_CLASS_CPU_CORES", "2"))
