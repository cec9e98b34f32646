"""ONNX: the spec's layer exported around the standard ``Attention`` op, run by ONNX Runtime and onnx's reference.

`graph` builds the model, `adapter` runs it (``onnx``, ``onnx-reference``), `decode` steps it
through ``past_key``/``present_key``, `known` holds what the op does with the spec's variants and its known
differences with their answers, `probe` calls the op bare to measure them.
Nothing here imports onnx or onnxruntime at module import.
"""
