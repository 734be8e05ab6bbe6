"""The web console (`outbox-farm console`): the farm's queues, its dead letters and its
processes, with replay and purge, and each queue's pause and limits. Server-rendered
(Starlette, Jinja2), live parts refreshed by htmx shipped in this package, nothing loaded from
elsewhere.

Needs the `console` extra: `pip install 'outbox-farm[console]'`. Only this package imports
Starlette, Jinja2 and uvicorn, so the rest of outbox_farm never pays for them.
"""

from .app import ConsoleSettings, create_app

__all__ = ["ConsoleSettings", "create_app"]
