"""Declarative tile-schedule spaces per arch and the generation targets."""
