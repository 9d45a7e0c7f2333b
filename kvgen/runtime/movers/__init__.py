"""Movers: what moves a connector's chunks, behind one protocol (base.Mover: prepare, move).

`native` (the compiled CPU kernel), `triton` (the generated Triton kernels) and `torch` (the
generated torch ops, the readable reference) each execute the plan of the generated module;
`choose` picks one per (connector, device) from the device registry, and maps the names
`backend=` takes to movers. `program` holds the planned description's data classes.
"""
