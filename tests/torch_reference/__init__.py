"""Test-only plain-PyTorch re-implementations of the official SCORER+CBR and DIRL+CCR models,
written from the notes in ``docs/official/`` for parity tests against the Flax ports."""
