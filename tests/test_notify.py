"""sd_notify against a fake NOTIFY_SOCKET (a real Unix datagram socket)."""

from __future__ import annotations

import socket

import pytest

from tuner.daemon.notify import Notifier


@pytest.fixture
def fake_systemd(tmp_path):
    path = tmp_path / "notify"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    yield path, s
    s.close()


def test_messages_arrive_as_systemd_reads_them(fake_systemd):
    path, sock = fake_systemd
    n = Notifier({"NOTIFY_SOCKET": str(path)}, monotonic_ns=lambda: 123_456_789_000)
    assert n.enabled
    assert n.ready("idle; jobs: 0 pending")
    assert sock.recv(4096) == b"READY=1\nSTATUS=idle; jobs: 0 pending"
    assert n.status("two\nlines")
    assert sock.recv(4096) == b"STATUS=two lines"
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert n.reloading()
    assert sock.recv(4096) == b"RELOADING=1\nMONOTONIC_USEC=123456789"
    assert n.stopping("bye")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=bye"
    n.close()


def test_abstract_namespace_socket():
    name = f"ctx-tuner-test-{id(object())}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.settimeout(2)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert s.recv(100) == b"WATCHDOG=1"
    finally:
        s.close()


def test_without_socket_everything_is_a_no_op_and_a_dead_socket_never_raises(tmp_path):
    n = Notifier({})
    assert not n.enabled and n.ready() is False and n.watchdog_interval_s is None
    dead = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert dead.ready() is False  # logged, not raised


def test_watchdog_interval_from_the_environment():
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s == 30.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "2"}, pid=2).watchdog_interval_s == 30.0
    assert Notifier({"WATCHDOG_USEC": "soon"}).watchdog_interval_s is None
