"""The class list from JupyterHub: its REST API's GET /hub/api/users, with the instructor's admin token.

The hub's users are its students (and its admins, graded too: one without notebooks gets rows that say so). The
API pages its answer when asked to (the `application/jupyterhub-pagination+json` Accept header, JupyterHub 2 and
later: {"items": [...], "_pagination": {"next": {"offset": ...}}}); an older hub answers one list, read as it is.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

__all__: list[str] = []

PAGE_USERS = 200  # JupyterHub's default page size
REQUEST_TIMEOUT_SECONDS = 30.0


def _get(url: str, token: str) -> object:
    """GET `url` with the token; its JSON. A refusal or an unreachable hub: RuntimeError saying what to check."""
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}",
                                                   "Accept": "application/jupyterhub-pagination+json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:  # noqa: S310 - the hub's URL
            return json.loads(response.read())
    except urllib.error.HTTPError as refused:
        raise RuntimeError(f"the hub answered {refused.code} {refused.reason} to GET {url}: the token must be an "
                           "admin's (or have the read:users scope)") from None
    except (urllib.error.URLError, OSError) as unreachable:
        raise RuntimeError(f"could not reach the hub at {url}: {unreachable}") from None


def hub_users(hub_url: str, token: str) -> list[str]:
    """The names of the hub's users, every page of them, in the hub's order."""
    if not token:
        raise ValueError("no hub token: set JUPYTERHUB_API_TOKEN or pass --token-file (an admin's API token, made "
                         "on the hub's Token page or with `jupyterhub token`)")
    base = hub_url.rstrip("/")
    base = base if base.endswith("/hub") else base + "/hub"
    names: list[str] = []
    offset = 0
    while True:
        page = _get(f"{base}/api/users?{urllib.parse.urlencode({'offset': offset, 'limit': PAGE_USERS})}", token)
        items = page.get("items", []) if isinstance(page, dict) else page
        names += [user["name"] for user in items]
        following = (page.get("_pagination") or {}).get("next") if isinstance(page, dict) else None
        if not following or not items:
            return names
        offset = following["offset"]
