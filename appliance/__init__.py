"""muxd: an LLM serving appliance."""
__version__ = "0.1.0"
