"""05 refresh: from the requests a deployment served to a refreshed draft, shipped only if it wins everywhere."""
