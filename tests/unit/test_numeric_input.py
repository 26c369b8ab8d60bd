"""Numbers read from the outside world (headers, addresses, config) accept ASCII digits of a
bounded length only: ``str.isdigit`` also accepts superscripts, which ``int`` refuses, and
fullwidth digits, which ``int`` reads; thousands of digits cost quadratic time or raise."""

from __future__ import annotations

import pytest

from epp.envoyconfig import split_host_port
from epp.errors import BadRequest, ConfigError
from epp.framework.endpoint import parse_endpoint_id
from epp.requestcontrol.admission import parse_deadline_ms
from epp.sync.peers import parse_host_port

BAD_PORTS = ["10.0.0.1:²", "10.0.0.1:\uff18\uff10\uff10\uff10", "10.0.0.1:" + "1" * 400,
             "10.0.0.1:" + "9" * 5000, "10.0.0.1:-1", "10.0.0.1:"]  # fmt: skip


@pytest.mark.parametrize("text", BAD_PORTS)
def test_a_bad_port_is_a_value_error_naming_the_address(text: str) -> None:
    with pytest.raises(ValueError, match=r"10\.0\.0\.1"):
        parse_endpoint_id(text)
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(text)
    with pytest.raises(ConfigError, match="host:port"):
        parse_host_port(text, "--sync-peers")


def test_good_addresses_still_parse() -> None:
    assert parse_endpoint_id("10.0.0.1:8000") == ("10.0.0.1", 8000)
    assert parse_endpoint_id("[fd00::1]:8000") == ("fd00::1", 8000)
    assert split_host_port("epp.local:9002") == ("epp.local", 9002)


@pytest.mark.parametrize(
    "raw", ["²", "\uff11\uff12", "1" * 11, "9" * 5000, "-5", "+5", "5.0", "", " "]
)
def test_a_deadline_that_is_no_count_of_milliseconds_is_a_bad_request(raw: str) -> None:
    with pytest.raises(BadRequest, match="x-gateway-request-deadline-ms"):
        parse_deadline_ms(raw)


def test_a_deadline_in_milliseconds_parses() -> None:
    assert parse_deadline_ms("0") == 0
    assert parse_deadline_ms(" 1500 ") == 1500
    assert parse_deadline_ms("9" * 10) == 9_999_999_999
