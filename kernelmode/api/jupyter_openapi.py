"""The OpenAPI entries of the Jupyter-gateway-compatible API (api/jupyter_api.py).

Its bodies are Jupyter's (kernel and kernelspec models), described here as plain objects: the
reference for them is Jupyter Server's own REST API.
"""

from __future__ import annotations

from typing import Any

TAG = {"name": "jupyter", "description": "Jupyter-gateway-compatible API: JupyterLab (--gateway-url) "
       "and VS Code attach to live sessions (a kernel is a session)"}

# (path, method) -> (operationId, tag)
OPERATIONS = {
    ("/api", "get"): ("jupyterVersion", "jupyter"),
    ("/api/kernelspecs", "get"): ("jupyterListKernelspecs", "jupyter"),
    ("/api/kernelspecs/{name}", "get"): ("jupyterGetKernelspec", "jupyter"),
    ("/kernelspecs/{name}/{path}", "get"): ("jupyterGetKernelspecResource", "jupyter"),
    ("/api/kernels", "get"): ("jupyterListKernels", "jupyter"),
    ("/api/kernels", "post"): ("jupyterStartKernel", "jupyter"),
    ("/api/kernels/{kernel_id}", "get"): ("jupyterGetKernel", "jupyter"),
    ("/api/kernels/{kernel_id}", "delete"): ("jupyterDeleteKernel", "jupyter"),
    ("/api/kernels/{kernel_id}/interrupt", "post"): ("jupyterInterruptKernel", "jupyter"),
    ("/api/kernels/{kernel_id}/restart", "post"): ("jupyterRestartKernel", "jupyter"),
    ("/api/kernels/{kernel_id}/channels", "get"): ("jupyterKernelChannels", "jupyter"),
    ("/api/sessions", "get"): ("jupyterListSessions", "jupyter"),
}


def jupyter_paths(errors: Any) -> dict[str, Any]:
    """The paths; ``errors(*codes)`` makes the error responses (openapi.py's ``_errors``)."""
    obj = {"content": {"application/json": {"schema": {"type": "object"}}}}
    arr = {"content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}
    kid = {"name": "kernel_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    path = {"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/api": {"get": {"summary": "Version (Jupyter Server's)",
                         "responses": {"200": {"description": "Version", **obj}, **errors(401)}}},
        "/api/kernelspecs": {"get": {"summary": "The kernelspec of this server's sandbox flavour, naming its limits",
                                     "responses": {"200": {"description": "Kernelspecs", **obj}, **errors(401)}}},
        "/api/kernelspecs/{name}": {"parameters": [name], "get": {
            "summary": "One kernelspec", "responses": {"200": {"description": "Kernelspec", **obj},
                                                       **errors(401, 404)}}},
        "/kernelspecs/{name}/{path}": {"parameters": [name, path], "get": {
            "summary": "A kernelspec resource (none: always 404)", "responses": errors(401, 404)}},
        "/api/kernels": {
            "get": {"summary": "The caller's live sessions as kernels",
                    "responses": {"200": {"description": "Kernel models", **arr}, **errors(401)}},
            "post": {"summary": "Start a kernel: a new session (from the warm pool)",
                     "requestBody": {"required": False, "content": {"application/json": {"schema": {
                         "type": "object", "properties": {"name": {"type": "string"}}}}}},
                     "responses": {"201": {"description": "Kernel model", **obj},
                                   **errors(401, 422, 429, 503)}},
        },
        "/api/kernels/{kernel_id}": {"parameters": [kid],
            "get": {"summary": "A kernel (session) model",
                    "responses": {"200": {"description": "Kernel model", **obj}, **errors(401, 404)}},
            "delete": {"summary": "Stop a kernel started through POST /api/kernels; for another "
                       "session (an agent's) only detach: the session stays",
                       "responses": {"204": {"description": "Stopped or detached"}, **errors(401, 404)}},
        },
        "/api/kernels/{kernel_id}/interrupt": {"parameters": [kid], "post": {
            "summary": "Interrupt the kernel", "responses": {"204": {"description": "Interrupted"},
                                                             **errors(401, 404, 503)}}},
        "/api/kernels/{kernel_id}/restart": {"parameters": [kid], "post": {
            "summary": "Restart the kernel (variables are lost)",
            "responses": {"200": {"description": "Kernel model", **obj}, **errors(401, 404, 503)}}},
        "/api/kernels/{kernel_id}/channels": {"parameters": [kid], "get": {
            "summary": "Websocket to the kernel's channels: v1.kernel.websocket.jupyter.org, or the "
                       "legacy JSON protocol without a subprotocol",
            "responses": {"101": {"description": "Switching protocols"}, **errors(401, 404, 503)}}},
        "/api/sessions": {"get": {"summary": "Jupyter notebook sessions (none: they live in the client's server)",
                                  "responses": {"200": {"description": "Sessions", **arr}, **errors(401)}}},
    }
