"""`iterserve lab --serve`: the /lab page and its endpoints on uvicorn, without a model.

The lab parses the flag; the page is the server's app (`create_app(engine=None)`), so the
handler lives here and the top-level CLI hands it to the lab's parser (iterserve/cli.py):
the lab imports nothing from the server.
"""

from __future__ import annotations

import uvicorn

from iterserve.server import app as app_module


def serve(host: str, port: int) -> int:
    # app_module.create_app, looked up per call: the app factory is the one to replace in a test
    uvicorn.run(app_module.create_app(engine=None), host=host, port=port)
    return 0
