"""Test-only plain-PyTorch re-implementations of the official SCORER+CBR and DIRL+CCR models,
written from ``shared/reference/official_pytorch.md`` for parity tests against the Flax ports."""
