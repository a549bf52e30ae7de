"""``python -m pdist doctor``: placeholder replaced below."""
