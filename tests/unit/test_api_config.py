"""The ``[http]`` section: listen addresses and token files."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.controller.api.server import load_tokens, parse_listen
from metalguard.controller.config import ConfigError, HttpSection, parse_config


def test_http_section_is_optional_and_has_defaults() -> None:
    assert parse_config('region = "r1"\n').http is None
    cfg = parse_config('region = "r1"\n[http]\n')
    assert cfg.http == HttpSection(listen="127.0.0.1:8480")
    with pytest.raises(ConfigError, match="http"):
        parse_config('region = "r1"\n[http]\nport = 1\n')


@pytest.mark.parametrize(
    ("listen", "expected"),
    [("127.0.0.1:8480", ("127.0.0.1", 8480)), ("[::1]:0", ("::1", 0)), ("h:1", ("h", 1))],
)
def test_parse_listen(listen: str, expected: tuple[str, int]) -> None:
    assert parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["8480", ":8480", "host:", "host:http", "h:70000"])
def test_bad_listen_names_the_key(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"http\.listen"):
        parse_listen(listen)


def test_token_files(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# admins\n\n  tok-a  \ntok-b\n")
    assert load_tokens(str(path), "admin_tokens_file") == {"tok-a", "tok-b"}
    assert load_tokens("", "admin_tokens_file") == frozenset()
    with pytest.raises(ConfigError, match=r"http\.read_tokens_file"):
        load_tokens(str(tmp_path / "missing"), "read_tokens_file")
