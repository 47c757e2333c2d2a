"""The configuration space parser against lspci itself: ``lspci -F DUMP -vvv`` decodes
each real dump of tests/fixtures/iommu/lspci/ (pciutils' test files, linux-pci mails:
PROVENANCE.md there), and the ACS and ATS the parser reads from the same bytes are what
lspci prints. Skipped, with the reason, where lspci (pciutils) is not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.iommu_dumps import DUMPS, config_of, decoded, ours


@pytest.mark.parametrize("dump", DUMPS, ids=[d.name.split(".lspci")[0] for d in DUMPS])
def test_acs_and_ats_as_lspci_decodes_the_same_bytes(dump: Path) -> None:
    if shutil.which("lspci") is None:
        pytest.skip("lspci (pciutils) is not installed: the published decodings are checked")
    done = subprocess.run(
        ["lspci", "-F", str(dump), "-vvv"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert ours(config_of(dump)) == decoded(done.stdout), dump.name
