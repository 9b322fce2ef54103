"""Experiments: studies (grids, seeds, tests), the batched sweep engine, reports and plots, `diff2
bench` and `diff2 audit`. Built on ``runtime`` (the audit also drives the Flower glue on purpose: it
audits the production path); never imported by it."""
