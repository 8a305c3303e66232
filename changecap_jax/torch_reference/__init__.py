"""The project's PyTorch reference of the official models: :mod:`.dirl` (DIRL+CCR) and
:mod:`.scorer` (SCORER+CBR), re-implemented in plain PyTorch from the notes in docs/official/;
the parity tests compare the Flax ports against them. PyTorch is optional: importing this
package does not import it."""
