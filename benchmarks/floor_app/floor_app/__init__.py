"""A do-nothing Flower app: measures the framework's per-round floor."""
