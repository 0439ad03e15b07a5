"""Tests of garcon_link.net.addresses: the one dial-URL parser, by a table of URLs (no sockets).

The configuration's wording of each refusal (file, field, fix) is tested in tests/test_config.py.
"""

from __future__ import annotations

import pytest

from garcon_link.core.wire import Role
from garcon_link.errors import ConfigError
from garcon_link.net.addresses import (
    DialTarget,
    DialUrlRefusal,
    check_dial_url,
    parse_dial_url,
)
from garcon_link.settings.config import LinkConfig
from garcon_link.settings.secrets import Secret

ACCEPTED = [
    ("wss://h.example/executor", DialTarget("wss", "h.example", 443)),
    ("ws://127.0.0.1/executor", DialTarget("ws", "127.0.0.1", 80)),
    ("WS://H.example:8080/executor", DialTarget("ws", "h.example", 8080)),
    ("ws://[::1]:9/executor", DialTarget("ws", "::1", 9)),
    ("ws://h:/executor", DialTarget("ws", "h", 80)),
    ("wss://h/executor?executor=box-1", DialTarget("wss", "h", 443, "box-1")),
]

REFUSED = [
    ("ws://h /executor", "the URL contains whitespace or control characters"),
    ("ws://h\x00/executor", "the URL contains whitespace or control characters"),
    ("ws://[::1/executor", "not a valid URL (Invalid IPv6 URL)"),
    ("http://h/executor", "the scheme is 'http', not ws or wss"),
    ("h/executor", "the scheme is no scheme, not ws or wss"),
    ("ws://user:pw@h/executor", "the URL carries userinfo (user:password@)"),
    ("ws://h/executor?", "the URL's query is not executor=<id>"),
    ("ws://h/executor?x=1", "the URL's query is not executor=<id>"),
    ("ws://h/executor?executor=a&executor=b", "the URL's query is not executor=<id>"),
    ("ws://h/executor?executor=.a", "the routing hint executor='.a': starts with '.'"),
    ("ws://h/executor#f", "the URL has a fragment (#...)"),
    ("ws://h/other", "the path is '/other', not '/executor'"),
    ("ws://h", "the path is '(empty)', not '/executor'"),
    ("ws:///executor", "the host is empty"),
    ("wss://1.2.3/executor", "'1.2.3' is not a valid IP address"),
    ("wss://-bad-/executor", "'-bad-' is neither an IP address nor a valid host name"),
    ("ws://h:abc/executor", "the port is not a number 1-65535"),
    ("ws://h:0/executor", "the port is not a number 1-65535"),
    ("ws://h:65536/executor", "the port is not a number 1-65535"),
]


@pytest.mark.parametrize(("url", "target"), ACCEPTED)
def test_an_accepted_url_gives_its_target(url: str, target: DialTarget) -> None:
    assert check_dial_url(url) == target
    assert parse_dial_url(url) == target


@pytest.mark.parametrize(("url", "problem"), REFUSED)
def test_a_refused_url_gives_the_first_rule_it_breaks(url: str, problem: str) -> None:
    found = check_dial_url(url)
    assert isinstance(found, DialUrlRefusal)
    assert found.problem == problem
    assert found.fix


@pytest.mark.parametrize(("url", "problem"), REFUSED)
def test_the_link_and_the_config_refuse_with_the_same_rule(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as in_code:
        parse_dial_url(url)
    with pytest.raises(ConfigError) as in_config:
        LinkConfig(
            executor_id="box",
            role=Role.CONTROLLER,
            secret=Secret(b"s" * 32),
            dial=url,
            allow_insecure_development=True,
        )
    assert str(in_code.value).startswith(f"dial URL: {problem}; ")
    assert str(in_config.value).startswith(f"LinkConfig: [connection] dial: {problem}; ")


def test_no_refusal_echoes_userinfo() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_dial_url("wss://admin:hunter2@h/executor")
    assert "hunter2" not in str(caught.value)


def test_the_target_spells_the_routing_hint_and_brackets_ipv6() -> None:
    assert DialTarget("ws", "::1", 9, "box-1").url == "ws://[::1]:9/executor?executor=box-1"
    assert DialTarget("wss", "h", 443).target == "/executor"
