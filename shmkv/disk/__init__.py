"""The disk tier: zstd-compressed, checked chunk files (format.py) in a
private directory with a byte cap (tier.py)."""
