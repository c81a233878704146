"""accel: offline model conversion for LLMs (Leech-lattice weights, SemKV/DAMP maps, Core ML / ANE export)."""

__version__ = "0.1.0"
