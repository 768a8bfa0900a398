"""Checking a layout before paying for it: a model family built tiny on this machine, trained a few
steps under a layout (tensor, pipeline, sharded) and under one process, in float64 throughout, and
compared parameter by parameter (``hvdtrain check-layout``; the sweep over every Hugging Face family,
``scripts/sweep_hf_layouts.py``). A leaf, as the benchmarks are: it drives the Trainer and nothing in
the library imports it.
"""
