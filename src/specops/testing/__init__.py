"""Test doubles that run as real loopback servers (see `specops.testing.fake_server`)."""
