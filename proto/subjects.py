"""Every NATS subject, stream and KV bucket of the design, built and parsed in one place.

Subjects (prefix ``mg`` by default)::

    <p>.tel.<region>.<cluster>.<node>               TelemetryBatch     stream <P>_TELEMETRY
    <p>.evt.<region>.<cluster>.<node>.<kind>        NodeEvent          stream <P>_EVENTS
    <p>.ctl.<region>.<kind...>                      ControllerEvent    stream <P>_CONTROL
    <p>.cmd.<region>.<cluster>.<node>.<verb>        Command (request/reply)
    <p>.dlq.<stream>                                undecodable messages, kept for inspection
    <p>.fed.summary.<region>                        region summary (federation)
    <p>.fed.submit.<region>                         job forwarding (request/reply)

Every token is validated: no ``.``, ``*``, ``>``, whitespace, and not empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_BAD_TOKEN = re.compile(r"[.*>\s]")
_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,32}")
DEFAULT_PREFIX: Final = "mg"
WILDCARD: Final = "*"


class SubjectError(ValueError):
    """A subject or token is not valid; the message names the bad token."""


def check_token(token: str, what: str = "token") -> str:
    """Return ``token`` if it can stand as one subject token, else raise SubjectError."""
    if not isinstance(token, str):
        raise SubjectError(f"{what} must be a string, got {type(token).__name__}")
    if not token:
        raise SubjectError(f"{what} is empty")
    bad = _BAD_TOKEN.search(token)
    if bad:
        raise SubjectError(f"{what} {token!r} contains {bad.group()!r}")
    return token


def _check_filter_token(token: str, what: str) -> str:
    return token if token == WILDCARD else check_token(token, what)


@dataclass(frozen=True, slots=True)
class TelemetrySubject:
    """``<p>.tel.<region>.<cluster>.<node>``"""

    region: str
    cluster: str
    node: str


@dataclass(frozen=True, slots=True)
class NodeEventSubject:
    """``<p>.evt.<region>.<cluster>.<node>.<kind>``"""

    region: str
    cluster: str
    node: str
    kind: str


@dataclass(frozen=True, slots=True)
class ControlSubject:
    """``<p>.ctl.<region>.<kind...>`` (kind is dotted, e.g. ``node.isolated``)"""

    region: str
    kind: str


@dataclass(frozen=True, slots=True)
class CommandSubject:
    """``<p>.cmd.<region>.<cluster>.<node>.<verb>``"""

    region: str
    cluster: str
    node: str
    verb: str


@dataclass(frozen=True, slots=True)
class FedSummarySubject:
    """``<p>.fed.summary.<region>``"""

    region: str


@dataclass(frozen=True, slots=True)
class FedSubmitSubject:
    """``<p>.fed.submit.<region>``"""

    region: str


@dataclass(frozen=True, slots=True)
class FedLookupSubject:
    """``<p>.fed.lookup.<region>``"""

    region: str


@dataclass(frozen=True, slots=True)
class DeadLetterSubject:
    """``<p>.dlq.<stream>``"""

    stream: str


ParsedSubject = (
    TelemetrySubject
    | NodeEventSubject
    | ControlSubject
    | CommandSubject
    | FedSummarySubject
    | FedSubmitSubject
    | FedLookupSubject
    | DeadLetterSubject
)


@dataclass(frozen=True, slots=True)
class Subjects:
    """Builds and parses the subjects, stream names and bucket names for one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_token(self.prefix, "prefix")
        if not _PREFIX.fullmatch(self.prefix):
            raise SubjectError(
                f"prefix {self.prefix!r} must be letters, digits, '_' or '-' "
                "(it also names streams and KV buckets)"
            )

    # --- builders -------------------------------------------------------------------
    def telemetry(self, region: str, cluster: str, node: str) -> str:
        """Subject of a node's TelemetryBatch; ``*`` allowed in any token for filters."""
        return self._join("tel", _node_tokens(region, cluster, node))

    def node_event(self, region: str, cluster: str, node: str, kind: str) -> str:
        """Subject of a NodeEvent."""
        tokens = [*_node_tokens(region, cluster, node), _check_filter_token(kind, "kind")]
        return self._join("evt", tokens)

    def control(self, region: str, kind: str) -> str:
        """Subject of a ControllerEvent; ``kind`` may be dotted (``node.isolated``)."""
        parts = kind.split(".") if isinstance(kind, str) else [kind]
        tokens = [_check_filter_token(region, "region")]
        tokens += [_check_filter_token(p, "kind") for p in parts]
        return self._join("ctl", tokens)

    def control_all(self, region: str) -> str:
        """``<p>.ctl.<region>.>``: every ControllerEvent of one region."""
        return self._join("ctl", [_check_filter_token(region, "region"), ">"])

    def command(self, region: str, cluster: str, node: str, verb: str) -> str:
        """Subject of a Command to one node."""
        tokens = [*_node_tokens(region, cluster, node), _check_filter_token(verb, "verb")]
        return self._join("cmd", tokens)

    def fed_summary(self, region: str) -> str:
        """Subject of a region's federation summary."""
        return self._join("fed", ["summary", _check_filter_token(region, "region")])

    def fed_submit(self, region: str) -> str:
        """Subject on which a region accepts forwarded jobs (request/reply)."""
        return self._join("fed", ["submit", _check_filter_token(region, "region")])

    def fed_lookup(self, region: str) -> str:
        """Subject on which a region answers node lookups by UUID (request/reply)."""
        return self._join("fed", ["lookup", _check_filter_token(region, "region")])

    def dead_letter(self, stream: str) -> str:
        """Subject where undecodable messages taken off ``stream`` are kept."""
        return self._join("dlq", [check_token(stream, "stream")])

    # --- wildcards for streams and subscriptions --------------------------------------
    def all_of(self, kind: str) -> str:
        """``<p>.<kind>.>``: everything of one subject family (a stream's subjects)."""
        return f"{self.prefix}.{check_token(kind, 'family')}.>"

    # --- streams and buckets ----------------------------------------------------------
    @property
    def stream_telemetry(self) -> str:
        """Stream holding every TelemetryBatch."""
        return f"{self.prefix.upper()}_TELEMETRY"

    @property
    def stream_events(self) -> str:
        """Stream holding every NodeEvent."""
        return f"{self.prefix.upper()}_EVENTS"

    @property
    def stream_control(self) -> str:
        """Stream holding every ControllerEvent."""
        return f"{self.prefix.upper()}_CONTROL"

    @property
    def stream_dead_letter(self) -> str:
        """Stream holding undecodable messages."""
        return f"{self.prefix.upper()}_DLQ"

    def bucket(self, name: str) -> str:
        """A KV bucket name: ``bucket("nodes")`` -> ``MG_NODES``."""
        return f"{self.prefix.upper()}_{check_token(name, 'bucket').upper()}"

    # --- parser -----------------------------------------------------------------------
    def parse(self, subject: str) -> ParsedSubject:
        """Parse any subject of the design; raise SubjectError naming what is wrong."""
        if not isinstance(subject, str) or not subject:
            raise SubjectError("subject is empty")
        tokens = subject.split(".")
        for i, tok in enumerate(tokens):
            check_token(tok, f"token {i + 1} of {subject!r}")
        if tokens[0] != self.prefix:
            raise SubjectError(f"subject {subject!r} does not start with prefix {self.prefix!r}")
        if len(tokens) < 2:
            raise SubjectError(f"subject {subject!r} has no family")
        family, rest = tokens[1], tokens[2:]
        match family, rest:
            case "tel", [region, cluster, node]:
                return TelemetrySubject(region, cluster, node)
            case "evt", [region, cluster, node, kind]:
                return NodeEventSubject(region, cluster, node, kind)
            case "ctl", [region, first, *more]:
                return ControlSubject(region, ".".join([first, *more]))
            case "cmd", [region, cluster, node, verb]:
                return CommandSubject(region, cluster, node, verb)
            case "fed", ["summary", region]:
                return FedSummarySubject(region)
            case "fed", ["submit", region]:
                return FedSubmitSubject(region)
            case "fed", ["lookup", region]:
                return FedLookupSubject(region)
            case "dlq", [stream]:
                return DeadLetterSubject(stream)
        raise SubjectError(f"subject {subject!r} matches no subject of the design")

    def _join(self, family: str, tokens: list[str]) -> str:
        return ".".join([self.prefix, family, *tokens])


def _node_tokens(region: str, cluster: str, node: str) -> list[str]:
    return [
        _check_filter_token(region, "region"),
        _check_filter_token(cluster, "cluster"),
        _check_filter_token(node, "node"),
    ]


DEFAULT_SUBJECTS: Final = Subjects()
"""Subjects under the default prefix ``mg``."""
