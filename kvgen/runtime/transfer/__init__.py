"""Layout-to-layout transfers at run time: `connector` (TransferBase, what every generated
transfer subclasses: binding, checks, the layer loop), `pairs` (a call's slot pairs, split into
whole blocks and single tokens) and `compiled` (the pairs moved by the compiled CPU kernel)."""
