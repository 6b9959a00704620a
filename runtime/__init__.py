"""Strata runtime: offload state, pools, threads."""
