"""The credentials file a ``[[bmc]]`` target names (docs/bmc.md): TOML, mode 0600.

One file serves every protocol: ``user``/``password`` for Redfish and IPMI, ``user`` plus
``auth_*``/``priv_*`` for SNMPv3 (USM).  Errors read ``FILE: key: problem``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

from metalguard.proto.access import ConfigSection
from metalguard.proto.documents import DocumentError, load_document

AuthProtocol = Literal["none", "md5", "sha", "sha224", "sha256", "sha384", "sha512"]
PrivProtocol = Literal["none", "des", "3des", "aes", "aes192", "aes256"]

MIN_KEY_LENGTH: Final = 8
"""RFC 3414: a USM pass phrase has at least 8 characters."""


class CredentialsError(DocumentError):
    """The credentials file is unreadable or invalid; names file, key and problem."""


class BmcCredentials(ConfigSection, frozen=True):
    """What a credentials file holds; which keys matter depends on the protocol."""

    user: str = ""
    """Redfish/IPMI user; the SNMPv3 security name."""
    password: str = ""
    auth_protocol: AuthProtocol | None = None
    """Default: ``sha`` when ``auth_key`` is set, else ``none``."""
    auth_key: str = ""
    priv_protocol: PrivProtocol | None = None
    """Default: ``aes`` when ``priv_key`` is set, else ``none``."""
    priv_key: str = ""

    def __post_init__(self) -> None:
        for key in ("auth_key", "priv_key"):
            value = getattr(self, key)
            if value and len(value) < MIN_KEY_LENGTH:
                raise ValueError(f"{key}: shorter than {MIN_KEY_LENGTH} characters")
        if self.priv_key and not self.auth_key:
            raise ValueError("priv_key: needs auth_key (SNMPv3 has no privacy without auth)")

    @property
    def auth(self) -> AuthProtocol:
        """The effective SNMPv3 authentication protocol."""
        if self.auth_protocol is not None:
            return self.auth_protocol
        return "sha" if self.auth_key else "none"

    @property
    def priv(self) -> PrivProtocol:
        """The effective SNMPv3 privacy protocol."""
        if self.priv_protocol is not None:
            return self.priv_protocol
        return "aes" if self.priv_key else "none"

    def security_level(self) -> str:
        """``noAuthNoPriv``, ``authNoPriv`` or ``authPriv`` (SNMPv3)."""
        if self.auth == "none":
            return "noAuthNoPriv"
        return "authNoPriv" if self.priv == "none" else "authPriv"


def parse_credentials(text: str, source: str = "<credentials>") -> BmcCredentials:
    """Parse a credentials document; CredentialsError naming source, key, problem."""
    return load_document(text, BmcCredentials, source=source, error=CredentialsError)


def load_credentials(path: str | Path) -> BmcCredentials:
    """Read and parse the credentials file at ``path``."""
    return load_document(Path(path), BmcCredentials, source=str(path), error=CredentialsError)
