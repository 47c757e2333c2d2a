"""proto.subjects: every builder round-trips through parse; bad tokens are named."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.state.streams import StreamSettings, stream_configs
from metalguard.proto.subjects import (
    DEFAULT_SUBJECTS,
    CommandSubject,
    ControlSubject,
    DeadLetterSubject,
    FedSubmitSubject,
    FedSummarySubject,
    NodeEventSubject,
    ParsedSubject,
    SubjectError,
    Subjects,
    TelemetrySubject,
    check_token,
)

EXAMPLES = settings(max_examples=60, deadline=None)

token_chars = st.characters(exclude_characters=".*>", codec="utf-8").filter(
    lambda c: not c.isspace() and not re.match(r"\s", c)
)
tokens = st.text(token_chars, min_size=1, max_size=12)
"""Valid subject tokens: any non-empty text without '.', '*', '>' or whitespace."""
dotted_kinds = st.lists(tokens, min_size=1, max_size=4).map(".".join)
prefixes = st.from_regex(r"[A-Za-z0-9_-]{1,32}", fullmatch=True).map(Subjects)
"""Valid prefixes: tokens that can also name streams and KV buckets."""

BAD_TOKENS = ["", "a.b", "a*", "*b", "a>", ">", "a b", "a\tb", "a\nb", " ", "a\n"]
"""Each is rejected wherever a token is expected ('*' alone is a filter wildcard)."""


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: '*' is one token, a trailing '>' is one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


# --- round trips ---------------------------------------------------------------------------


@EXAMPLES
@given(s=prefixes, region=tokens, cluster=tokens, node=tokens)
def test_telemetry_round_trip(s: Subjects, region: str, cluster: str, node: str) -> None:
    subject = s.telemetry(region, cluster, node)
    assert subject == f"{s.prefix}.tel.{region}.{cluster}.{node}"
    assert s.parse(subject) == TelemetrySubject(region, cluster, node)


@EXAMPLES
@given(s=prefixes, region=tokens, cluster=tokens, node=tokens, kind=tokens)
def test_node_event_round_trip(
    s: Subjects, region: str, cluster: str, node: str, kind: str
) -> None:
    subject = s.node_event(region, cluster, node, kind)
    assert subject == f"{s.prefix}.evt.{region}.{cluster}.{node}.{kind}"
    assert s.parse(subject) == NodeEventSubject(region, cluster, node, kind)


@EXAMPLES
@given(s=prefixes, region=tokens, kind=dotted_kinds)
def test_control_round_trip_with_dotted_kinds(s: Subjects, region: str, kind: str) -> None:
    subject = s.control(region, kind)
    assert subject == f"{s.prefix}.ctl.{region}.{kind}"
    assert s.parse(subject) == ControlSubject(region, kind)


@pytest.mark.parametrize("kind", ["node.isolated", "job.rescheduled", "rail.tripped", "x"])
def test_control_documented_kinds(kind: str) -> None:
    subject = DEFAULT_SUBJECTS.control("eu-west", kind)
    assert subject == f"mg.ctl.eu-west.{kind}"
    assert DEFAULT_SUBJECTS.parse(subject) == ControlSubject("eu-west", kind)


@EXAMPLES
@given(s=prefixes, region=tokens, cluster=tokens, node=tokens, verb=tokens)
def test_command_round_trip(s: Subjects, region: str, cluster: str, node: str, verb: str) -> None:
    subject = s.command(region, cluster, node, verb)
    assert subject == f"{s.prefix}.cmd.{region}.{cluster}.{node}.{verb}"
    assert s.parse(subject) == CommandSubject(region, cluster, node, verb)


@EXAMPLES
@given(s=prefixes, region=tokens)
def test_fed_summary_round_trip(s: Subjects, region: str) -> None:
    subject = s.fed_summary(region)
    assert subject == f"{s.prefix}.fed.summary.{region}"
    assert s.parse(subject) == FedSummarySubject(region)


@EXAMPLES
@given(s=prefixes, region=tokens)
def test_fed_submit_round_trip(s: Subjects, region: str) -> None:
    subject = s.fed_submit(region)
    assert subject == f"{s.prefix}.fed.submit.{region}"
    assert s.parse(subject) == FedSubmitSubject(region)


@pytest.mark.parametrize("region", ["summary", "submit"])
def test_fed_subjects_of_regions_named_like_the_fixed_tokens(region: str) -> None:
    """Regions called 'summary' or 'submit' once made fed_submit and fed_summary build
    the same subject ('mg.fed.summary.submit'), which parse could not invert."""
    s = DEFAULT_SUBJECTS
    assert s.fed_submit(region) != s.fed_summary(region)
    assert s.parse(s.fed_submit(region)) == FedSubmitSubject(region)
    assert s.parse(s.fed_summary(region)) == FedSummarySubject(region)
    assert s.fed_submit("summary") != s.fed_summary("submit")


@EXAMPLES
@given(s=prefixes, stream=tokens)
def test_dead_letter_round_trip(s: Subjects, stream: str) -> None:
    subject = s.dead_letter(stream)
    assert subject == f"{s.prefix}.dlq.{stream}"
    assert s.parse(subject) == DeadLetterSubject(stream)


@pytest.mark.parametrize("prefix", ["a:b", "é", "x" * 33, "a/b"])
def test_prefix_must_also_suit_stream_and_bucket_names(prefix: str) -> None:
    with pytest.raises(SubjectError, match="streams and KV buckets"):
        Subjects(prefix)


def test_default_prefix() -> None:
    assert DEFAULT_SUBJECTS.prefix == "mg"
    assert DEFAULT_SUBJECTS.telemetry("eu", "c1", "n17") == "mg.tel.eu.c1.n17"


def test_filter_wildcards_are_accepted_by_builders() -> None:
    s = DEFAULT_SUBJECTS
    assert s.telemetry("*", "*", "*") == "mg.tel.*.*.*"
    assert s.node_event("eu", "*", "*", "*") == "mg.evt.eu.*.*.*"
    assert s.control("*", "node.*") == "mg.ctl.*.node.*"
    assert s.command("eu", "c1", "*", "*") == "mg.cmd.eu.c1.*.*"
    assert s.fed_summary("*") == "mg.fed.summary.*"
    assert s.all_of("tel") == "mg.tel.>"


@pytest.mark.parametrize("subject", ["mg.tel.*.c.n", "mg.tel.>", "mg.evt.r.c.n.*"])
def test_parse_rejects_filters(subject: str) -> None:
    with pytest.raises(SubjectError):
        DEFAULT_SUBJECTS.parse(subject)


# --- bad tokens ----------------------------------------------------------------------------

Builder = Callable[[Subjects, str], str]
BUILDER_POSITIONS: dict[str, tuple[str, Builder]] = {
    "telemetry.region": ("region", lambda s, t: s.telemetry(t, "c", "n")),
    "telemetry.cluster": ("cluster", lambda s, t: s.telemetry("r", t, "n")),
    "telemetry.node": ("node", lambda s, t: s.telemetry("r", "c", t)),
    "node_event.region": ("region", lambda s, t: s.node_event(t, "c", "n", "k")),
    "node_event.cluster": ("cluster", lambda s, t: s.node_event("r", t, "n", "k")),
    "node_event.node": ("node", lambda s, t: s.node_event("r", "c", t, "k")),
    "node_event.kind": ("kind", lambda s, t: s.node_event("r", "c", "n", t)),
    "control.region": ("region", lambda s, t: s.control(t, "node.isolated")),
    "command.region": ("region", lambda s, t: s.command(t, "c", "n", "v")),
    "command.cluster": ("cluster", lambda s, t: s.command("r", t, "n", "v")),
    "command.node": ("node", lambda s, t: s.command("r", "c", t, "v")),
    "command.verb": ("verb", lambda s, t: s.command("r", "c", "n", t)),
    "fed_summary.region": ("region", lambda s, t: s.fed_summary(t)),
    "fed_submit.region": ("region", lambda s, t: s.fed_submit(t)),
    "dead_letter.stream": ("stream", lambda s, t: s.dead_letter(t)),
    "all_of.family": ("family", lambda s, t: s.all_of(t)),
    "bucket.name": ("bucket", lambda s, t: s.bucket(t)),
    "Subjects.prefix": ("prefix", lambda _s, t: Subjects(t).prefix),
}


def assert_names(err: SubjectError, what: str, bad: str) -> None:
    message = str(err)
    assert what in message, f"{message!r} does not say which token ({what})"
    if bad:
        assert repr(bad) in message, f"{message!r} does not show the bad token {bad!r}"
    else:
        assert "empty" in message


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
@pytest.mark.parametrize("position", BUILDER_POSITIONS)
def test_builders_reject_bad_tokens(position: str, bad: str) -> None:
    what, build = BUILDER_POSITIONS[position]
    with pytest.raises(SubjectError) as info:
        build(DEFAULT_SUBJECTS, bad)
    assert_names(info.value, what, bad)


@pytest.mark.parametrize(
    ("kind", "bad"),
    [
        ("", ""),
        ("node..isolated", ""),
        (".node", ""),
        ("node.", ""),
        ("node.iso lated", "iso lated"),
        ("node.a*", "a*"),
        ("node.>", ">"),
        ("node.\tx", "\tx"),
        ("node.x\n", "x\n"),
    ],
)
def test_control_rejects_bad_kind_parts(kind: str, bad: str) -> None:
    with pytest.raises(SubjectError) as info:
        DEFAULT_SUBJECTS.control("eu", kind)
    assert_names(info.value, "kind", bad)


@pytest.mark.parametrize("bad", ["*", "a*"])
def test_non_filter_positions_reject_wildcards(bad: str) -> None:
    for build in (DEFAULT_SUBJECTS.dead_letter, DEFAULT_SUBJECTS.bucket, Subjects):
        with pytest.raises(SubjectError, match=re.escape(repr(bad))):
            build(bad)


@EXAMPLES
@given(
    bad=st.sampled_from([".", "*", ">", " ", "\t", "\n", "\r", "\u00a0", "\u2003"]),
    good=tokens,
    where=st.integers(0, 2),
)
def test_check_token_rejects_bad_characters_anywhere(bad: str, good: str, where: int) -> None:
    token = [bad + good, good + bad, good + bad + good][where]
    with pytest.raises(SubjectError) as info:
        check_token(token, "region")
    assert_names(info.value, "region", token)


def test_check_token_rejects_non_strings() -> None:
    with pytest.raises(SubjectError, match="region must be a string"):
        check_token(17, "region")  # type: ignore[arg-type]


# --- parse -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "subject",
    [
        "xx.tel.r.c.n",
        "mgx.tel.r.c.n",
        "m.tel.r.c.n",
        "MG.tel.r.c.n",
        "tel.r.c.n",
        "other.evt.r.c.n.k",
    ],
)
def test_parse_rejects_foreign_prefixes(subject: str) -> None:
    with pytest.raises(SubjectError, match="does not start with prefix 'mg'"):
        DEFAULT_SUBJECTS.parse(subject)


@EXAMPLES
@given(s=prefixes, other=prefixes, region=tokens, cluster=tokens, node=tokens)
def test_parse_rejects_another_prefix(
    s: Subjects, other: Subjects, region: str, cluster: str, node: str
) -> None:
    subject = other.telemetry(region, cluster, node)
    if other.prefix == s.prefix:
        assert s.parse(subject) == TelemetrySubject(region, cluster, node)
    else:
        with pytest.raises(SubjectError, match="prefix"):
            s.parse(subject)


@pytest.mark.parametrize(
    "subject",
    [
        "mg",
        "mg.tel",
        "mg.tel.r.c",
        "mg.tel.r.c.n.extra",
        "mg.evt.r.c.n",
        "mg.evt.r.c.n.k.extra",
        "mg.ctl",
        "mg.ctl.r",
        "mg.cmd.r.c.n",
        "mg.cmd.r.c.n.v.extra",
        "mg.fed",
        "mg.fed.r",
        "mg.fed.r.other",
        "mg.fed.r.submit",
        "mg.fed.submit",
        "mg.fed.submit.r.extra",
        "mg.fed.summary",
        "mg.fed.summary.r.extra",
        "mg.dlq",
        "mg.dlq.a.b",
        "mg.nope.r.c.n",
        "mg.TEL.r.c.n",
    ],
)
def test_parse_rejects_malformed_subjects(subject: str) -> None:
    with pytest.raises(SubjectError, match=re.escape(repr(subject))):
        DEFAULT_SUBJECTS.parse(subject)


@pytest.mark.parametrize(
    ("subject", "bad"),
    [
        ("", ""),
        ("mg..r.c.n", ""),
        (".mg.tel.r.c.n", ""),
        ("mg.tel.r.c.n.", ""),
        ("mg.tel.r c.c.n", "r c"),
        ("mg.tel.r.c.n\n", "n\n"),
        ("mg.tel.r.c\t.n", "c\t"),
        ("mg.tel.*.c.n", "*"),
        ("mg.tel.>", ">"),
    ],
)
def test_parse_rejects_bad_tokens(subject: str, bad: str) -> None:
    with pytest.raises(SubjectError) as info:
        DEFAULT_SUBJECTS.parse(subject)
    message = str(info.value)
    assert (repr(bad) in message) if bad else ("empty" in message)


# --- streams and buckets ---------------------------------------------------------------------


@EXAMPLES
@given(s=prefixes, bucket=tokens)
def test_stream_and_bucket_names_derive_from_the_prefix(s: Subjects, bucket: str) -> None:
    upper = s.prefix.upper()
    streams = [s.stream_telemetry, s.stream_events, s.stream_control, s.stream_dead_letter]
    assert streams == [f"{upper}_{n}" for n in ("TELEMETRY", "EVENTS", "CONTROL", "DLQ")]
    assert s.bucket(bucket) == f"{upper}_{bucket.upper()}"


def test_default_stream_and_bucket_names() -> None:
    s = DEFAULT_SUBJECTS
    assert s.stream_telemetry == "MG_TELEMETRY"
    assert s.stream_events == "MG_EVENTS"
    assert s.stream_control == "MG_CONTROL"
    assert s.stream_dead_letter == "MG_DLQ"
    assert s.bucket("nodes") == "MG_NODES"
    assert Subjects("acme").bucket("leases") == "ACME_LEASES"


@EXAMPLES
@given(s=prefixes, region=tokens, cluster=tokens, node=tokens, kind=dotted_kinds)
def test_each_published_subject_lands_in_exactly_its_stream(
    s: Subjects, region: str, cluster: str, node: str, kind: str
) -> None:
    """The streams the controller creates (controller.streams) capture what the builders
    produce, each in exactly one stream; request/reply subjects in none."""
    configs = stream_configs(s, StreamSettings())

    def streams_of(subject: str) -> list[str]:
        return [str(c.name) for c in configs if any(matches(f, subject) for f in c.subjects or [])]

    expected: list[tuple[str, list[str]]] = [
        (s.telemetry(region, cluster, node), [s.stream_telemetry]),
        (s.node_event(region, cluster, node, kind.split(".")[0]), [s.stream_events]),
        (s.control(region, kind), [s.stream_control]),
        (s.dead_letter(s.stream_telemetry), [s.stream_dead_letter]),
        (s.command(region, cluster, node, "drain"), []),
        (s.fed_summary(region), []),
        (s.fed_submit(region), []),
    ]
    for subject, streams in expected:
        assert streams_of(subject) == streams, subject


def test_subjects_parse_returns_one_of_the_declared_types() -> None:
    s = DEFAULT_SUBJECTS
    parsed: list[ParsedSubject] = [
        s.parse(s.telemetry("r", "c", "n")),
        s.parse(s.node_event("r", "c", "n", "k")),
        s.parse(s.control("r", "a.b")),
        s.parse(s.command("r", "c", "n", "v")),
        s.parse(s.fed_summary("r")),
        s.parse(s.fed_submit("r")),
        s.parse(s.dead_letter("S")),
    ]
    assert len({type(p) for p in parsed}) == len(parsed)
