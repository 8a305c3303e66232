"""The commands users run on trained models (``python -m changecap_jax COMMAND``, the table in
``changecap_jax/__main__.py``): the top layer, which nothing in the library imports."""
