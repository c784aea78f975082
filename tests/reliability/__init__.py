"""The reliability suite: real processes, real signals, real full disks, hung sockets (RELIABILITY.md)."""
