"""The class's hub as deployed (deploy/jupyterhub_config.py), with a test authenticator and ports of the test's.

The deployment logs students in with PAM, the machine's passwords; the test's students have no Unix password,
so each logs in with one of their own from a 0600 file the test writes (LABKIT_TEST_PASSWORDS): a wrong password,
or another student's, is refused as PAM would refuse it. Everything else is the deployment's.
"""

import hmac
import json
import os
from pathlib import Path

from jupyterhub.auth import Authenticator

c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)
load_subconfig(str(Path(__file__).resolve().parents[2] / "deploy" / "jupyterhub_config.py"))  # noqa: F821

PASSWORDS = json.loads(Path(os.environ["LABKIT_TEST_PASSWORDS"]).read_text())


class ClassListAuthenticator(Authenticator):
    """Each listed student with their own password; nobody else."""

    async def authenticate(self, handler, data):
        expected = PASSWORDS.get(data["username"])
        if expected and hmac.compare_digest(expected.encode(), data["password"].encode()):
            return data["username"]
        return None


c.JupyterHub.authenticator_class = ClassListAuthenticator
c.Authenticator.allow_all = False
c.Authenticator.allowed_users = set(PASSWORDS)
c.JupyterHub.hub_port = int(os.environ["LABKIT_TEST_HUB_API_PORT"])
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ['LABKIT_TEST_PROXY_API_PORT']}"
