"""What a `dlora serve` or `dlora batch run` process assembles: the server state with the batch
service on it, the FastAPI app with every route, and the two commands.

The top layer: the batch service runs its lines through the server's handlers, so whatever puts
the two together sits above both (docs/architecture.md, "Layers").
"""
