"""`nmt serve`: trained models over HTTP, a thin layer over the Python API (nmt/api.py).

- `models`: the served models (loaded once, named, routed by language pair) and limits.
- `batcher`: lines from concurrent requests merged into the model's batches.
- `app`: the Starlette app: LibreTranslate's API, the native /v1 API, errors and limits.
- `page/`: the page at `/` to try the models in a browser (HTML, CSS, JS; package data).

Needs the `serve` extra (starlette, uvicorn); the rest of nmt never imports this package.
May import the shared modules, nmt.data, nmt.model, nmt.inference and nmt.api.
"""
