"""pagelm on Ray Serve: `pagelm serve MODEL --replicas N` runs a thin ingress (the same OpenAI
and Ollama routes as one `pagelm serve`) in front of N engine replicas that each map the model file.

`router` sends a conversation back to the replica whose prefix cache holds it; `wire` is what
travels between ingress and engine; `deployments` builds the Serve application; `run` is the
command. Ray is the optional extra `pagelm[cluster]`: `require_ray()` says so when it is missing.
"""

from __future__ import annotations

from pagelm.errors import PagelmError

APP_NAME = "pagelm"


def require_ray():
    """Ray Serve's module, or a PagelmError saying how to install it."""
    try:
        from ray import serve
    except ImportError as e:
        raise PagelmError(f"--replicas needs Ray Serve, which is not installed ({e}): "
                          f"pip install 'pagelm[cluster]'") from None
    return serve
