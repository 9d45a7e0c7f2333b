"""The independent side of every proof: element addresses, the reference interpreter and
test scenarios. Reads specs, never plans or generated code."""
