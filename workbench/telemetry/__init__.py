"""Events, the streaming zarr recorder, the store schema and readers."""
