"""The real vLLM server for tests: see specops.serverproc (shared with `specops serve`)."""

from ..serverproc import (  # noqa: F401
    DEFAULT_ENV,
    DEFAULT_HOST,
    VllmServer,
    VllmServerError,
    find_vllm_python,
    free_port,
    start_vllm_server,
)
