"""The agent's small JSON state files (the XID ledger, the kernel log's cursor and the
pstore dumps it read), each replaced whole in one rename."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def write_json(path: Path, doc: object, what: str) -> bool:
    """Replace ``path`` with ``doc`` as JSON atomically; False (logged, naming ``what``)
    when it cannot be written: the caller keeps its state in memory and writes again."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("%s %s not written (%s): kept in memory", what, path, exc)
        return False
    return True
