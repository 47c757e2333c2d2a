"""Every asyncio task's stack, for a controller that seems stuck (``kill -USR1 <pid>``
makes ``metalguard controller run`` log them: docs/operations.md)."""

from __future__ import annotations

import asyncio
import io
import logging

log = logging.getLogger(__name__)


def task_stacks() -> str:
    """The running loop's tasks, each with its name and where it waits (innermost last)."""
    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    out.write(f"{len(tasks)} asyncio tasks\n")
    for task in tasks:
        out.write(f"--- task {task.get_name()}\n")
        task.print_stack(file=out)
    return out.getvalue()


def log_task_stacks() -> None:
    """Log :func:`task_stacks` at WARNING (seen at every log level but error)."""
    log.warning("asyncio tasks on SIGUSR1:\n%s", task_stacks())
