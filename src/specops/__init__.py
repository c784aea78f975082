"""specops: EAGLE-3 drafter campaigns with flight checks."""
__version__ = "0.1.0"
