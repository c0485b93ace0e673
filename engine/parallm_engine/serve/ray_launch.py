"""``parallm serve --ray``: start a local Ray instance (or join one) and run :mod:`parallm_engine.serve.ray_serve`'s
app on ``--port``. Imports no Ray until asked: without the ``ray`` extra, ``--ray`` is a typed error naming it."""

from __future__ import annotations

import time

from parallm_engine.errors import InvalidRequestError, ParaLLMError

RAY_EXTRA_HINT = "pip install 'parallm-engine[ray]' (or 'parallm-integrations[ray]'; it installs ray[serve])"


class RayNotInstalledError(ParaLLMError):
    """``parallm serve --ray`` (or :mod:`parallm_engine.serve.ray_serve`) without Ray Serve installed."""


def require_ray() -> None:
    """Raise :class:`RayNotInstalledError` unless ``ray[serve]`` can be imported."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise RayNotInstalledError(f"`parallm serve --ray` needs Ray Serve, which is not installed ({exc}): "
                                   f"{RAY_EXTRA_HINT}") from exc


def serve_on_ray(model=None, *, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
                 app_name: str = "parallm", **build_kwargs) -> None:
    """Deploy :func:`~parallm_engine.serve.ray_serve.build_app` (``build_kwargs``) and serve until interrupted.
    ``ray_address``: a running Ray cluster (``auto``, ``ray://host:10001``, ``host:6379``); None starts a local
    instance (or joins ``$RAY_ADDRESS``)."""
    require_ray()
    import ray
    from ray import serve

    from parallm_engine.serve.ray_serve import build_app

    app = build_app(model, **build_kwargs)  # argument errors before anything starts
    ray.init(address=ray_address, include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=app_name, route_prefix="/", blocking=False)
        n = build_kwargs.get("replicas", 2)
        scale = (f"{build_kwargs.get('min_replicas')}-{build_kwargs.get('max_replicas')} replicas (autoscaled)"
                 if build_kwargs.get("max_replicas") is not None else f"{n} replica{'s' if n != 1 else ''}")
        shown = f"[{host}]" if ":" in host else host
        print(f"ParaLLM on Ray Serve: {scale} of {model or 'the default model'} at http://{shown}:{port}/v1 "
              f"(routing: {build_kwargs.get('routing', 'prefix')}; /replicas lists them)", flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def check_ray_arguments(args) -> None:
    """The ``--ray`` options make sense only with ``--ray``."""
    given = [flag for flag, name in (("--replicas", "replicas"), ("--ray-address", "ray_address"),
                                     ("--min-replicas", "min_replicas"), ("--max-replicas", "max_replicas"))
             if getattr(args, name, None) is not None]
    if given and not getattr(args, "ray", False):
        raise InvalidRequestError(f"{', '.join(given)} need --ray", param="ray")
