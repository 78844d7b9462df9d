"""One module per strategy; import them from `jaxdist`."""
