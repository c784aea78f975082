"""One exception hierarchy, classified by what the caller does next.

`SpecopsError` subclasses are user-facing: the CLI prints `Type: message` on one line and exits
non-zero. Invariant violations inside specops stay `AssertionError`.
"""


class SpecopsError(Exception):
    """A problem the user can fix (bad config, bad input, a busy campaign). Exit code 2."""

    exit_code = 2


class ConfigError(SpecopsError):
    """campaign.toml is invalid; the message names the key."""


class InputError(SpecopsError):
    """An input file or dataset cannot be read at all (single bad records are quarantined instead)."""


class CampaignLocked(SpecopsError):
    """Another live process holds the campaign lock."""


class EvalWorkerFailed(SpecopsError):
    """An eval worker process raised or was killed; the message carries its error and exit code."""


class Interrupted(SpecopsError):
    """SIGINT/SIGTERM stopped a phase cleanly; rerunning resumes it."""

    exit_code = 130


class DiskFull(SpecopsError):
    """No space left (ENOSPC, EDQUOT, EFBIG): what was written is consistent; rerun after freeing space."""
