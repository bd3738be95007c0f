"""Model files and their formats: GGUF metadata, model shapes, sources, sampling defaults,
the formats each kind of node runs and the converters between them, and the demo model.

Nothing here loads a model or imports an engine: the engines, the node agents and the
service read model files through this package."""
