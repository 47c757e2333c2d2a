"""The CLI's HTTP client and terminal output without a server: the API's errors made
readable, an unusable URL, tables and JSON."""

from __future__ import annotations

import io
import json
from email.message import Message
from urllib.error import HTTPError

import pytest

from metalguard.controller.cli.console import MAX_CELL, CliError, guarded, print_json, table
from metalguard.controller.cli.http import ApiClient, error_text


def http_error(code: int, body: bytes) -> HTTPError:
    return HTTPError("http://api/v1/jobs", code, "Unprocessable", Message(), io.BytesIO(body))


def test_an_api_error_is_its_message_and_code() -> None:
    body = json.dumps({"error": {"code": "not_found", "message": "no job 'j'"}}).encode()
    assert error_text(http_error(404, body), "invalid job") == "no job 'j' (HTTP 404 not_found)"


def test_an_invalid_document_lists_its_reasons_one_per_line() -> None:
    error = {"code": "invalid_job", "message": "invalid job: a; b", "reasons": ["a", "b"]}
    text = error_text(http_error(422, json.dumps({"error": error}).encode()), "invalid job")
    assert text == "invalid job (HTTP 422 invalid_job):\n  - a\n  - b"


def test_an_answer_that_is_not_the_api_s_json_is_its_status_line() -> None:
    assert error_text(http_error(502, b"<html>"), "invalid job") == "HTTP 502 Unprocessable"


def test_a_url_urllib_cannot_open_is_exit_status_1_naming_it() -> None:
    with pytest.raises(CliError, match="cannot reach the API at not-a-url") as failed:
        ApiClient("not-a-url").get("/v1/nodes")
    assert failed.value.code == 1


def test_guarded_prints_a_cli_error_and_returns_its_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fail(_: object) -> int:
        raise CliError("no such node", 2)

    assert guarded(fail)(None) == 2  # type: ignore[arg-type]
    assert capsys.readouterr().err == "metalguard: no such node\n"


def test_tables_align_columns_and_cut_long_cells() -> None:
    text = table(["A", "BB"], [["x", ""], ["long" * 20, "y"]])
    lines = text.splitlines()
    assert lines[0] == "A" + " " * (MAX_CELL + 1) + "BB"
    assert lines[1].split() == ["x", "-"]
    cut = lines[2].split()[0]
    assert cut.endswith("…")
    assert len(cut) == MAX_CELL
    assert table([], []) == ""


def test_json_output_is_sorted_and_indented() -> None:
    out = io.StringIO()
    assert print_json({"b": 1, "a": [1]}, out) == 0
    assert out.getvalue() == '{\n  "a": [\n    1\n  ],\n  "b": 1\n}\n'
