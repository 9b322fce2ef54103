"""A client that returns the parameters it was sent: no computation at all."""

from flwr.client import ClientApp, NumPyClient


class Echo(NumPyClient):
    """A client that computes nothing: a round's cost is then Flower's own."""

    def fit(self, parameters, config):
        """The parameters sent, unchanged, as one example's update with no metrics."""
        return parameters, 1, {}


app = ClientApp(client_fn=lambda context: Echo().to_client())
