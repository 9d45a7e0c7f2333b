"""What generated modules and the runtime agree on, stated once for both sides.

No torch here: the emitter writes these values into generated code, the runtime checks them.
"""

#: Version of the interface between generated modules and kvgen.runtime. A generated
#: module states the version it was written for and refuses to load under another.
ABI = 5

#: The label of a freshly allocated memory object (LMCache's code 0).
UNDEFINED = "UNDEFINED"
