"""``metalguard demo --http`` is checked like ``[http] listen``: a bad address exits 2."""

from __future__ import annotations

import pytest

from metalguard.cli import build_parser


@pytest.mark.parametrize("good", ["127.0.0.1:8480", "[::1]:0", "localhost:9000"])
def test_a_listen_address_is_taken(good: str) -> None:
    assert build_parser().parse_args(["demo", "--http", good]).http == good


@pytest.mark.parametrize("bad", ["8480", "127.0.0.1", "http://127.0.0.1:8480", "::1:8480"])
def test_a_bad_listen_address_exits_2_with_the_problem(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["demo", "--http", bad])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --http" in err
    assert bad in err
