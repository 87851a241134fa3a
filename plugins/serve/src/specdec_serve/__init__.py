"""specdec-plugin-serve: ``specdec serve``, an OpenAI-compatible server that speculates.

    specdec serve --model path/to/model --policy copy --port 8080

Point any OpenAI client at ``http://127.0.0.1:8080/v1``; a ``policy`` field in the
request body (``extra_body={"policy": "copy"}`` with the ``openai`` client) picks
the policy per request, and every response carries a ``specdec`` object with
tokens per forward, acceptance and what each drafter drafted.
"""

from __future__ import annotations

from .app import APIError, make_app
from .engine import Engine, Job, Metrics

__version__ = "0.5.1"

__all__ = ["APIError", "Engine", "Job", "Metrics", "make_app"]
