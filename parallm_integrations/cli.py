"""The ``parallm`` command: the engine's command line (``parallm_engine.cli``: info, generate, demo, serve,
pull, models, bench), with a clear message instead of a traceback where the engine extra is not installed."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from parallm_engine.cli import main as engine_main
    except ImportError as exc:
        from .errors import ENGINE_MODULES

        if exc.name not in ENGINE_MODULES:
            raise
        print(
            "parallm: the ParaLLM engine is not installed here (it runs the model locally: info, generate, "
            "demo, serve, bench). Install it with `pip install 'parallm-integrations[engine]'` "
            "(on Linux with MLX's backend: `[engine,cpu]`, or `[engine,cuda13]` / `[engine,cuda12]`). Without it, "
            "ChatParaLLM / ParaLLM / ParaLLMLlamaIndex work with base_url= (a ParaLLM or OpenAI-compatible server).",
            file=sys.stderr,
        )
        return 1
    return engine_main(argv)


if __name__ == "__main__":
    sys.exit(main())
