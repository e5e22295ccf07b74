"""Retention strategies, cost model, traces, simulator and reports for `kvtier ab`."""
