"""mt: the Transformer of "Attention Is All You Need", from parallel text to sacreBLEU."""

__version__ = "0.1.0"
