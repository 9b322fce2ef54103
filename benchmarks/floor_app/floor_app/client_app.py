"""A client that returns the parameters it was sent: no computation at all."""

from flwr.client import ClientApp, NumPyClient


class Echo(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 1, {}


app = ClientApp(client_fn=lambda context: Echo().to_client())
