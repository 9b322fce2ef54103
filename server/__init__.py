"""The Flower ServerApp of diff2-flwr."""
