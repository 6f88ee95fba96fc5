"""viz: plotly figure builders (Dataset / DataArray in, ``go.Figure`` out)."""
