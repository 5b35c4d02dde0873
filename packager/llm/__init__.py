"""Decoder language models: an ONNX decoder with a KV cache, compiled into two static steps (prefill and decode)
that a loader drives to generate tokens. ``decoder`` reads and specializes the ONNX graph, ``build`` imports and
compiles the steps, ``generate`` is the loop both the host and the bundle's run.py use."""
