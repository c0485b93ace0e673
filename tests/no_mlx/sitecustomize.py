"""Put this directory on PYTHONPATH and the top-level packages named in ``PARALLM_BLOCK_IMPORTS``
(comma-separated; default ``mlx,mlx_lm``) cannot be imported in that Python process: every import of
them, or of anything under them, raises ``ModuleNotFoundError`` as on a machine where they are not
installed. ``tests/test_remote_without_mlx.py`` runs the ``base_url=`` classes this way."""

import os
import sys
from importlib.abc import MetaPathFinder

BLOCKED = frozenset(filter(None, os.environ.get("PARALLM_BLOCK_IMPORTS", "mlx,mlx_lm").split(",")))


class _Unimportable(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (made unimportable for this test)", name=name)
        return None


sys.meta_path.insert(0, _Unimportable())
