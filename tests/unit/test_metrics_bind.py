"""`exposition.listen`: every way --metrics-bind can fail is one ConfigurationError naming it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from outbox_farm.errors import ConfigurationError
from outbox_farm.prefork.exposition import listen
from outbox_farm.settings import parse_bind


@pytest.fixture
def taken() -> Iterator[int]:
    """A port something is listening on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield int(sock.getsockname()[1])


def test_a_port_in_use_is_a_configuration_error_naming_the_option(taken: int) -> None:
    with pytest.raises(ConfigurationError) as caught:
        listen(f"127.0.0.1:{taken}")
    message = str(caught.value)
    assert message.startswith(f"--metrics-bind 127.0.0.1:{taken}: cannot listen")
    assert "pick a free port" in message
    assert "\n" not in message


def test_an_address_of_another_machine_says_what_to_use() -> None:
    with pytest.raises(ConfigurationError, match="use an address of this machine"):
        listen("192.0.2.1:0")  # TEST-NET-1: never a local address


def test_an_unknown_host_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"^--metrics-bind no-such-host\.invalid:0"):
        listen("no-such-host.invalid:0")


@pytest.mark.parametrize("bind", ["9464", "localhost", "127.0.0.1:", "h:65536", "h:-1", "::1:80"])
def test_a_malformed_value_is_a_configuration_error(bind: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^--metrics-bind '"):
        listen(bind)


def test_port_zero_binds_a_free_port_on_loopback() -> None:
    with listen(":0") as sock:
        host, port = sock.getsockname()[:2]
    assert host == "127.0.0.1"
    assert port > 0


def ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_address_binds_an_ipv6_socket() -> None:
    """The README promises `[::1]:9464`: it once failed with "Unknown error -9", the IPv6
    address handed to an IPv4 socket."""
    with listen("[::1]:0") as sock:
        host, port = sock.getsockname()[:2]
    assert sock.family == socket.AF_INET6
    assert (host, port > 0) == ("::1", True)


@pytest.mark.parametrize(
    ("bind", "address"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        (":0", ("127.0.0.1", 0)),
        ("[::1]:65535", ("::1", 65535)),
        (" 0.0.0.0:80 ", ("0.0.0.0", 80)),
    ],
)
def test_parse_bind(bind: str, address: tuple[str, int]) -> None:
    assert parse_bind(bind) == address
