"""Engine replicas on Ray Serve behind one OpenAI-compatible endpoint (the optional extra
`pip install -e '.[ray]'`).

    from ray import serve
    from conveyor.config import EngineArgs
    from conveyor.deploy import DeployConfig, build_app

    app = build_app(EngineArgs(model="model.gguf"), deploy_config=DeployConfig(replicas=2,
                    routing="prefix"))
    serve.run(app, name="conveyor", route_prefix="/")

`conveyor serve --replicas N [--routing prefix]` does the same from the command line.
"""

from __future__ import annotations

from typing import Any

from conveyor.deploy.config import DeployConfig, RayNotInstalledError, require_ray

__all__ = ["DeployConfig", "RayNotInstalledError", "build_app", "serve_replicas"]


def build_app(*args: Any, **kwargs: Any) -> Any:
    """conveyor.deploy.app.build_app; RayNotInstalledError (naming the extra) without Ray."""
    require_ray()
    from conveyor.deploy.app import build_app as build

    return build(*args, **kwargs)


def serve_replicas(*args: Any, **kwargs: Any) -> int:
    """conveyor.deploy.app.serve_replicas; RayNotInstalledError without Ray."""
    require_ray()
    from conveyor.deploy.app import serve_replicas as run

    return run(*args, **kwargs)
