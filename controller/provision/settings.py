"""The provisioning service's settings (``[provision]`` in the controller config)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from metalguard.controller.config import ProvisionSection
from metalguard.controller.provision.spec import normalize_mac


@dataclass(frozen=True, slots=True)
class ProvisionSettings:
    """The service's knobs (:meth:`from_section`; docs/provisioning.md)."""

    macs: Mapping[str, str] = field(default_factory=dict)
    """Node handle -> boot MAC (lower case, colons): the nodes it may deploy."""
    boot_url: str = "http://127.0.0.1:8490"
    """The boot server as the nodes reach it (no trailing slash)."""
    nbd_host: str = "127.0.0.1"
    nbd_port: int = 10809
    """The NBD export server as the nodes reach it."""
    kernel: str = ""
    initrd: str = ""
    kernel_args: str = ""
    """More kernel command-line words (``[provision] kernel_args``)."""
    deploy_timeout_s: float = 600.0
    deploy_attempts: int = 3
    max_failures: int = 3
    tick_s: float = 1.0
    release_retry_s: float = 10.0
    """A release whose power-off failed is tried again this often (by the passes)."""
    image_source_dirs: tuple[str, ...] = ()
    """Where images may be built from (empty: anywhere)."""

    @classmethod
    def from_section(cls, section: ProvisionSection) -> ProvisionSettings:
        """The settings of a ``[provision]`` section."""
        host, port = section.nbd_endpoint
        return cls(
            macs={n.node: normalize_mac(n.mac) for n in section.nodes},
            boot_url=section.base_url,
            nbd_host=host,
            nbd_port=port,
            kernel=section.kernel,
            initrd=section.initrd,
            kernel_args=section.kernel_args,
            deploy_timeout_s=section.deploy_timeout_s,
            deploy_attempts=section.deploy_attempts,
            max_failures=section.max_failures,
            tick_s=section.tick_s,
            release_retry_s=max(10 * section.tick_s, 1.0),
            image_source_dirs=section.image_source_dirs,
        )
