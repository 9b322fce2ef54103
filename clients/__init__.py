"""The Flower ClientApp of diff2-flwr."""
