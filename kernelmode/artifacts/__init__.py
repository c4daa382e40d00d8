"""Files out of kernels: the session workspace, the Harvester, and artifact stores (local, S3)."""
