"""Core ML / Apple Neural Engine export: the ANE-friendly Llama, encodings, placement rules, the NumPy MIL
interpreter, the probe harness and the primitive sweep (docs/ane.md)."""
