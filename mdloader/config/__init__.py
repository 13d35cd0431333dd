"""The input.json of DeePMD-kit as mdloader reads it: the dargs schema, the frozen
configuration, and what it refuses."""
