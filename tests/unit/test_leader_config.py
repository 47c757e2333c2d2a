"""The ``[ha]`` section and the HTTPS keys of the controller's config."""

from __future__ import annotations

import pytest

from metalguard.controller.api.server import https_context
from metalguard.controller.config import ConfigError, HttpSection, parse_config


def test_ha_section_names_the_instance_and_its_timing() -> None:
    cfg = parse_config('region = "r1"\n[ha]\ninstance = "ctl-a"\nrenew_s = 2\n', "c.toml")
    assert cfg.ha is not None
    assert (cfg.ha.instance, cfg.ha.renew_s, cfg.ha.poll_s) == ("ctl-a", 2.0, 0.5)
    assert parse_config('region = "r1"\n').ha is None


def test_ha_without_an_instance_is_an_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"c\.toml: .*instance"):
        parse_config('region = "r1"\n[ha]\nrenew_s = 2\n', "c.toml")


def test_inbox_prefix_is_a_nats_key() -> None:
    cfg = parse_config('region = "r1"\n[nats]\ninbox_prefix = "_INBOX_MG.ctl"\n')
    assert cfg.nats.inbox_prefix == "_INBOX_MG.ctl"


def test_https_needs_both_certificate_and_key() -> None:
    assert https_context(HttpSection()) is None
    with pytest.raises(ConfigError, match=r"http\.tls_cert"):
        https_context(HttpSection(tls_cert="/x.pem"))
    with pytest.raises(ConfigError, match=r"http\.tls_cert: unusable"):
        https_context(HttpSection(tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"))
