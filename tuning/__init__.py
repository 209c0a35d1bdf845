"""Tuning tables: one JSON per GPU, written by `dflashgen tune`."""
