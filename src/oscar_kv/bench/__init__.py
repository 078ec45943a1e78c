"""GPU benchmarks.  ``attention``: paged INT2 decode attention vs BF16 baselines (see attention.py)."""
