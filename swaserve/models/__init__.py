"""Model families (one file each, only what differs) and the architecture registry."""
