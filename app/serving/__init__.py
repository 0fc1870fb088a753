"""The serving core: each model's `GenerationService` over the registry, and the dependencies routes take."""
