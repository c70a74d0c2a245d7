"""Multi-host tests: pskv-launch across network-namespace hosts (marker multihost)."""
