"""Built-in model configs and deployments."""
