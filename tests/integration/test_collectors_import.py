"""The collector package is lazy to import: in a fresh interpreter, importing it loads no
collector module but ``base`` and none of nats, aiohttp, pysnmp, pyudev or pyroute2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_package_import_is_light(tmp_path: Path) -> None:
    code = (
        "import sys, metalguard.agent.collectors\n"
        "bad = [m for m in sys.modules if m.startswith('metalguard.agent.collectors.') and m != "
        "'metalguard.agent.collectors.base'] + [m for m in ('nats', 'aiohttp', 'pysnmp', 'pyudev', "
        "'pyroute2') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(  # from elsewhere: the checkout's folders are not on sys.path
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.stdout.strip() == ""
