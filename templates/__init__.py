"""Jinja2 templates and the CUDA headers they include (kernel logic lives in include/)."""
